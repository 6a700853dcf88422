"""Small pieces several test modules share (DeepLift, RevealCancel, NeuronLRP): imported as ``zoo`` is."""
import torch
from torch import nn

import relprop

D = torch.float64


def target_values(model, x, target):
    """The model's output at ``target`` per example (summed where the target picks several entries)."""
    with torch.no_grad():
        out = model(x)
    return (out * relprop.methods.target_mask(out, target)).flatten(1).sum(1)


def with_weights(module, weight, bias=None):
    """``module`` with the given weight (and bias), for closed forms by hand."""
    with torch.no_grad():
        module.weight.copy_(torch.as_tensor(weight, dtype=D))
        if bias is not None:
            module.bias.copy_(torch.as_tensor(bias, dtype=D))
    return module


class Embedded(nn.Module):
    """A causal language model on its input embeddings (a floating-point input), returning the logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, embeddings):
        return self.model(inputs_embeds=embeddings).logits


def rms_norm(self, hidden):
    """Hugging Face's Llama RMSNorm in the model's own precision (it computes in float32): every op in float64."""
    return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
