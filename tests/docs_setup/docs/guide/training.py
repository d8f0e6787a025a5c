"""docs/guide/training.md's examples: a small MLP, a few batches, its state dict in model.pt."""
import torch
import torch.distributed as dist


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


generator = torch.Generator().manual_seed(0)
loader = [(torch.randn(32, 16, generator=generator), torch.randint(0, 4, (32,), generator=generator))
          for _ in range(3)]
x_test = torch.randn(8, 16, generator=generator)
if dist.get_rank() == 0:
    torch.save(make_model().state_dict(), "model.pt")
dist.barrier()
