"""Programs from torch.export: their aten ops get the rules of the torch functions they stand for."""
import pytest
import torch
import torchvision

from relprop import LRP
from relprop.workflows.mnist import SmallCNN


def exported(model, *inputs):
    # the program keeps the mode it was exported in (eval here); its module refuses .eval()
    return torch.export.export(model, inputs).module()


@pytest.mark.parametrize("preset", ["epsilon", "epsilon-plus-flat", "epsilon-alpha2-beta1"])
@pytest.mark.parametrize("build, shape", [
    (SmallCNN, (2, 1, 28, 28)),
    (torchvision.models.resnet18, (2, 3, 32, 32)),  # batch_norm (arguments reordered), add_, relu_
    (torchvision.models.densenet121, (1, 3, 32, 32)),  # cat, avg_pool2d
    (torchvision.models.mobilenet_v2, (1, 3, 32, 32)),  # hardtanh_, dropout
], ids=["small-cnn", "resnet18", "densenet121", "mobilenet-v2"])
def test_exported_cnn_equals_the_eager_model(build, shape, preset):
    torch.manual_seed(0)
    model = build().eval()
    x = torch.rand(shape)
    expected = LRP(model, preset).attribute(x, target=1)
    assert expected.abs().sum() > 0
    got = LRP(exported(model, x), preset, strict=True).attribute(x, target=1)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


@pytest.mark.parametrize("preset", ["attnlrp", "cp-lrp"])
def test_exported_llama_equals_the_eager_model(preset):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=32)
    llama = transformers.LlamaForCausalLM(config).eval()

    class LastLogits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.llama = llama

        def forward(self, embeds):
            return self.llama(inputs_embeds=embeds, use_cache=False).logits[:, -1]

    model = LastLogits()
    embeds = llama.get_input_embeddings()(torch.randint(0, 50, (1, 6))).detach()
    expected = LRP(model, preset).attribute(embeds, target=3)
    got = LRP(exported(model, embeds), preset, strict=True).attribute(embeds, target=3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
