"""Train a GAN on a generated 2-D Gaussian mixture, with manual optimization and two optimizers.

The module sets ``self.automatic_optimization = False`` and steps its generator's and its
discriminator's optimizers by hand (``self.optimizers()``, ``toggle_optimizer``,
``manual_backward``) inside ``training_step``, which runs on the Monarch workers exactly as on
DDP ranks. As under ``strategy="ddp_find_unused_parameters_true"``, DDP must be told that a
backward pass leaves some parameters without gradients: ``MonarchStrategy`` forwards
``find_unused_parameters=True`` to the workers' ``DistributedDataParallel``.

After ``fit``, the script's own ``model`` holds the trained weights: the controller samples the
generator and reports how many of the eight modes it covers.

    python examples/gan.py [--devices 2] [--max-epochs 40]
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_monarch import MonarchStrategy

MODES = 8
RADIUS = 2.0
STD = 0.05


def mode_centers() -> torch.Tensor:
    """The mixture's means: ``MODES`` points evenly spaced on a circle."""
    angles = torch.arange(MODES) * 2 * math.pi / MODES
    return RADIUS * torch.stack([angles.cos(), angles.sin()], dim=1)


def sample_ring(count: int, seed: int) -> torch.Tensor:
    """``count`` points of the mixture: a random mode plus Gaussian noise of ``STD``."""
    generator = torch.Generator().manual_seed(seed)
    modes = torch.randint(MODES, (count,), generator=generator)
    return mode_centers()[modes] + STD * torch.randn(count, 2, generator=generator)


class RingDataModule(L.LightningDataModule):
    """The same generated points on every worker; each trains on its DistributedSampler shard."""

    def __init__(self, size: int = 8192, batch_size: int = 128) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.points = TensorDataset(sample_ring(self.hparams.size, seed=0))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.points, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)


def mlp(inputs: int, outputs: int, hidden: int, activation: nn.Module) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, hidden), activation, nn.Linear(hidden, hidden), activation, nn.Linear(hidden, outputs)
    )


class GAN(L.LightningModule):
    """A generator from ``latent_dim`` noise to 2-D points and a discriminator that scores points."""

    def __init__(self, latent_dim: int = 8, hidden: int = 128, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = mlp(latent_dim, 2, hidden, nn.ReLU())
        self.discriminator = mlp(2, 1, hidden, nn.LeakyReLU(0.2))

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        return self.generator(noise)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()
        real = batch[0]
        noise = torch.randn(len(real), self.hparams.latent_dim, device=self.device)
        real_label, fake_label = (
            torch.ones(len(real), 1, device=self.device),
            torch.zeros(len(real), 1, device=self.device),
        )
        bce = nn.functional.binary_cross_entropy_with_logits

        self.toggle_optimizer(d_opt)
        fake = self.generator(noise).detach()
        d_loss = (bce(self.discriminator(real), real_label) + bce(self.discriminator(fake), fake_label)) / 2
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        self.untoggle_optimizer(d_opt)

        self.toggle_optimizer(g_opt)
        g_loss = bce(self.discriminator(self.generator(noise)), real_label)
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        betas = (0.5, 0.999)
        return [
            torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=betas),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=betas),
        ]


def mode_coverage(generator: nn.Module, latent_dim: int, count: int = 4000) -> tuple[int, float]:
    """How many modes get at least a tenth of their share of ``count`` samples, and the fraction
    of samples within 3 standard deviations of a mode."""
    with torch.no_grad():
        samples = generator(torch.randn(count, latent_dim, generator=torch.Generator().manual_seed(1)))
    distance, nearest = torch.cdist(samples, mode_centers()).min(dim=1)
    close = distance < 3 * STD
    per_mode = torch.bincount(nearest[close], minlength=MODES)
    return int((per_mode >= 0.1 * count / MODES).sum()), close.float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=40)
    parser.add_argument("--dataset-size", type=int, default=8192, help="generated points")
    parser.add_argument("--default-root-dir", default=None, help="where logs and checkpoints go (default: here)")
    args = parser.parse_args()

    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=MonarchStrategy(find_unused_parameters=True),
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.max_epochs,
        default_root_dir=args.default_root_dir,
        log_every_n_steps=10,
    )
    model = GAN()
    trainer.fit(model, datamodule=RingDataModule(size=args.dataset_size))
    covered, close = mode_coverage(model.generator, model.hparams.latent_dim)
    print(f"Modes covered: {covered}/{MODES}; samples within 3 std of a mode: {close:.1%}")


if __name__ == "__main__":
    main()
