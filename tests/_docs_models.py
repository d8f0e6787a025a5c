"""What several pages' setups (tests/docs_setup) give their Python blocks alike: the
8-layer MLP the checkpoint pages save and the loss of a causal language model."""
import torch
import torch.nn.functional as F

__all__ = ["causal_lm_loss", "make_mlp"]


def make_mlp() -> torch.nn.Sequential:
    """Eight layers (four Linear(16, 16) + ReLU pairs), the same weights on every rank."""
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def causal_lm_loss(out, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of a Hugging Face causal LM's logits against the token ids."""
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
