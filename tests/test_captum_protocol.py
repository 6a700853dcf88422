"""captum's Attribution protocol: relprop's classes inside captum's NoiseTunnel and metrics, against captum itself."""
import pytest
import torch
from torch import nn

import relprop
from relprop import methods

captum_attr = pytest.importorskip("captum.attr")
captum_metrics = pytest.importorskip("captum.metrics")


def relu_net():
    """A small ReLU CNN with biases (LRP-0 = Gradient x Input holds on it)."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 3 * 3, 8), nn.ReLU(), nn.Linear(8, 3)).double().eval()


def images(n=4):
    return torch.randn(n, 2, 6, 6, dtype=torch.float64)


def lrp0(model):
    return relprop.LRP(model, relprop.composites.Epsilon(0.0))


def smooth_by_hand(attribute, x, samples, stdev, seed, **kwargs):
    """SmoothGrad of ``attribute`` as NoiseTunnel defines it: the mean over noisy copies drawn in one batch."""
    torch.manual_seed(seed)
    copies = x.repeat_interleave(samples, 0)
    noisy = copies + torch.normal(0.0, torch.full(copies.shape, stdev))  # captum draws float32 noise
    per_copy = attribute(noisy, **kwargs)
    return per_copy.reshape(x.shape[0], samples, *per_copy.shape[1:]).mean(1)


@pytest.mark.parametrize("make", [lambda m: relprop.LRP(m, "epsilon-plus"), lambda m: methods.InputGradient(m),
                                  lambda m: methods.GradientXInput(m)], ids=["LRP", "InputGradient", "GradientXInput"])
def test_noise_tunnel_equals_smoothing_by_hand(make):
    model, x = relu_net(), images()
    method = make(model)
    torch.manual_seed(5)
    tunnel = captum_attr.NoiseTunnel(method).attribute(x, nt_type="smoothgrad", nt_samples=3, stdevs=0.1, target=2)
    target = [2] * (x.shape[0] * 3)
    by_hand = smooth_by_hand(method.attribute, x, 3, 0.1, seed=5, target=target)
    torch.testing.assert_close(tunnel, by_hand, rtol=1e-12, atol=1e-12)
    assert tunnel.abs().sum() > 0


def test_noise_tunnel_with_per_example_targets_and_convergence_delta():
    model, x = relu_net(), images()
    lrp = lrp0(model)
    torch.manual_seed(3)
    tunnel, delta = captum_attr.NoiseTunnel(lrp).attribute(x, nt_samples=2, stdevs=0.2, target=[0, 1, 2, 1],
                                                           return_convergence_delta=True)
    torch.manual_seed(3)
    copies = x.repeat_interleave(2, 0)
    noisy = copies + torch.normal(0.0, torch.full(copies.shape, 0.2))
    relevance, per_copy_delta = lrp.attribute(noisy, target=[0, 0, 1, 1, 2, 2, 1, 1], return_convergence_delta=True)
    torch.testing.assert_close(tunnel, relevance.reshape(4, 2, *x.shape[1:]).mean(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(delta, per_copy_delta)
    assert delta.shape == (8,) and delta.abs().max() > 1e-6  # biases absorb relevance: the delta is not 0


def test_noise_tunnel_over_layer_lrp():
    model, x = relu_net(), images(2)
    layer = relprop.LayerLRP(model, "4")
    torch.manual_seed(7)
    tunnel = captum_attr.NoiseTunnel(layer).attribute(x, nt_samples=3, stdevs=0.1, target=1)
    by_hand = smooth_by_hand(layer.attribute, x, 3, 0.1, seed=7, target=1)
    assert tunnel.shape == (2, 8)
    torch.testing.assert_close(tunnel, by_hand, rtol=1e-12, atol=1e-12)


def test_input_gradient_in_noise_tunnel_equals_captum_saliency_without_abs():
    model, x = relu_net(), images()
    torch.manual_seed(11)
    ours = captum_attr.NoiseTunnel(methods.InputGradient(model)).attribute(x, nt_samples=4, stdevs=0.3, target=0)
    torch.manual_seed(11)
    theirs = captum_attr.NoiseTunnel(captum_attr.Saliency(model)).attribute(x, nt_samples=4, stdevs=0.3, target=0,
                                                                           abs=False)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_integrated_gradients_in_noise_tunnel_equals_captums():
    model = nn.Sequential(nn.Flatten(), nn.Linear(72, 10), nn.Tanh(), nn.Linear(10, 3)).double().eval()
    x = images(2)
    results = []
    for method in (methods.IntegratedGradients(model), captum_attr.IntegratedGradients(model)):
        torch.manual_seed(9)
        results.append(captum_attr.NoiseTunnel(method).attribute(
            x, nt_samples=3, stdevs=0.1, target=1, baselines=0.0, n_steps=16, method="riemann_middle",
            return_convergence_delta=True))
    (ours, our_delta), (theirs, their_delta) = results
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(our_delta, their_delta, rtol=1e-4, atol=1e-6)
    assert our_delta.shape == (6,)


@pytest.mark.parametrize("method", ["gausslegendre", "riemann_middle", "riemann_trapezoid", "riemann_left"])
def test_integrated_gradients_equals_captums(method):
    model = nn.Sequential(nn.Flatten(), nn.Linear(72, 10), nn.Tanh(), nn.Linear(10, 3)).double().eval()
    x, baseline = images(), torch.rand(1, 2, 6, 6, dtype=torch.float64)
    ours, our_delta = methods.IntegratedGradients(model).attribute(
        x, baselines=baseline, target=[0, 2, 1, 0], n_steps=24, method=method, internal_batch_size=7,
        return_convergence_delta=True)
    theirs, their_delta = captum_attr.IntegratedGradients(model).attribute(
        x, baselines=baseline, target=[0, 2, 1, 0], n_steps=24, method=method, return_convergence_delta=True)
    if method == "riemann_trapezoid":
        # captum 0.9's trapezoid weights are 1/n (halved at the ends), summing to (n-1)/n; ours are 1/(n-1)
        theirs = theirs * 24 / 23
    else:  # the delta of captum's trapezoid includes its missing 1/n of the integral
        torch.testing.assert_close(our_delta, their_delta, rtol=1e-4, atol=1e-6)
    # captum rounds its path positions and weights to float32
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_protocol_flags_and_names_match_captums_counterparts():
    model = relu_net()
    pairs = [(relprop.LRP(model), captum_attr.LRP(model)),
             (methods.InputGradient(model), captum_attr.Saliency(model)),
             (methods.GradientXInput(model), captum_attr.InputXGradient(model)),
             (methods.IntegratedGradients(model), captum_attr.IntegratedGradients(model)),
             (methods.IntegratedGradients(model, multiply_by_inputs=False),
              captum_attr.IntegratedGradients(model, multiply_by_inputs=False)),
             (relprop.LayerLRP(model, "4"), captum_attr.LayerLRP(model, model[4]))]
    for ours, theirs in pairs:
        assert ours.forward_func is model
        assert ours.multiplies_by_inputs == theirs.multiplies_by_inputs, type(ours)
        assert ours.has_convergence_delta() == theirs.has_convergence_delta(), type(ours)
    assert [c.get_name() for c in (relprop.LRP, relprop.LayerLRP, methods.InputGradient, methods.GradientXInput,
                                   methods.IntegratedGradients, methods.SmoothGrad)] == [
        "LRP", "Layer LRP", "Input Gradient", "Gradient X Input", "Integrated Gradients", "Smooth Grad"]
    assert methods.Occlusion(model).multiplies_by_inputs == captum_attr.Occlusion(model).multiplies_by_inputs
    assert not methods.Occlusion(model).has_convergence_delta()
    with pytest.raises(NotImplementedError, match="Occlusion has no convergence delta"):
        methods.Occlusion(model).compute_convergence_delta(images())


def test_compute_convergence_delta_matches_attribute_and_captum_lrp():
    model, x = relu_net(), images()
    lrp = relprop.LRP(model, "epsilon")
    relevance, delta = lrp.attribute(x, target=1, return_convergence_delta=True)
    output = model(x)[:, 1].detach()
    torch.testing.assert_close(lrp.compute_convergence_delta(relevance, output), delta, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(captum_attr.LRP(model).compute_convergence_delta(relevance, output), delta,
                               rtol=1e-12, atol=1e-12)


def test_infidelity_equals_captums_for_lrp0_and_input_x_gradient():
    """On a ReLU net LRP-0 is Gradient x Input: the same attributions give captum's infidelity to the digit."""
    model, x = relu_net(), images()
    ours = lrp0(model).attribute(x, target=2)
    theirs = captum_attr.InputXGradient(model).attribute(x, target=2)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)

    def perturb(inputs):
        noise = torch.randn_like(inputs) * 0.1
        return noise, inputs - noise

    scores = []
    for method, attributions in [(lrp0(model), ours), (captum_attr.InputXGradient(model), theirs)]:
        torch.manual_seed(2)
        scores.append(captum_metrics.infidelity(method.forward_func, perturb, x, attributions, target=2,
                                                n_perturb_samples=5))
    assert scores[0].shape == (4,) and (scores[0] > 0).all()
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-8, atol=1e-12)


def test_sensitivity_max_equals_captums_where_the_methods_coincide():
    model, x = relu_net(), images()
    cases = [(lrp0(model).attribute, captum_attr.InputXGradient(model).attribute, {}),
             (methods.InputGradient(model).attribute, captum_attr.Saliency(model).attribute, {"abs": False})]
    for ours, theirs, their_options in cases:
        torch.manual_seed(4)
        our_score = captum_metrics.sensitivity_max(ours, x, target=torch.tensor([1]), n_perturb_samples=3)
        torch.manual_seed(4)
        their_score = captum_metrics.sensitivity_max(lambda inputs, **kw: theirs(inputs, **kw, **their_options), x,
                                                     target=1, n_perturb_samples=3)
        assert our_score.shape == (4,) and (our_score > 0).any()
        torch.testing.assert_close(our_score, their_score, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("make, options", [
    (lambda m: relprop.LRP(m), {}), (lambda m: methods.InputGradient(m), {}),
    (lambda m: methods.IntegratedGradients(m), {}), (lambda m: relprop.LayerLRP(m, "4"), {}),
    (lambda m: methods.Occlusion(m), {"sliding_window_shapes": (2, 3, 3), "strides": (1, 3, 3)})],
    ids=["LRP", "InputGradient", "IntegratedGradients", "LayerLRP", "Occlusion"])
def test_a_target_of_one_broadcasts_over_the_batch(make, options):
    model, x = relu_net(), images()
    method = make(model)
    by_int = method.attribute(x, target=2, **options)
    for one in (torch.tensor([2]), [2], torch.tensor(2)):
        torch.testing.assert_close(method.attribute(x, target=one, **options), by_int, rtol=0, atol=0)


def test_occlusion_equals_captums_with_cut_windows_and_tuple_inputs():
    model, x = relu_net(), images()
    options = dict(sliding_window_shapes=(1, 4, 4), strides=(1, 3, 3), baselines=0.25, target=[0, 2, 1, 0])
    ours = methods.Occlusion(model).attribute(x, perturbations_per_eval=3, **options)
    theirs = captum_attr.Occlusion(model).attribute(x, **options)
    assert ours.dtype == torch.float64  # captum 0.9 returns float32 here: compare to its precision
    torch.testing.assert_close(ours, theirs.double(), rtol=1e-5, atol=1e-6)

    class TwoInputs(nn.Module):
        def forward(self, a, b, scale):
            return model(a + b[:, :, None, None]) * scale

    b, scale = torch.randn(4, 2, dtype=torch.float64), torch.tensor([[1.0], [2.0], [0.5], [-1.0]], dtype=torch.float64)
    options = dict(sliding_window_shapes=((2, 2, 2), (1,)), strides=((1, 2, 2), 1), target=1,
                   additional_forward_args=(scale,))
    ours = methods.Occlusion(TwoInputs()).attribute((x, b), **options)
    theirs = captum_attr.Occlusion(TwoInputs()).attribute((x, b), **options)
    for mine, captums in zip(ours, theirs):
        torch.testing.assert_close(mine, captums.double(), rtol=1e-5, atol=1e-6)


def test_target_lists_of_other_lengths_are_refused():
    with pytest.raises(ValueError, match="2 targets given for a batch of 4"):
        relprop.LRP(relu_net()).attribute(images(), target=[0, 1])
