"""Train a small transformer language model with ``lightning.pytorch.demos``' Transformer and WikiText2.

``WikiText2`` reads ``<data-dir>/wikitext-2.txt`` and, with ``download=True``, first fetches the
real WikiText-2 from GitHub. So that this example runs offline, the datamodule's
``prepare_data`` writes a generated corpus to that file instead: sentences of a small English-like
grammar with number agreement ("the red fox chases some dogs ."), which a model can learn and a
uniform guess cannot. ``prepare_data`` runs on the workers, once per host (local rank 0), as under
DDP; ``setup`` then reads the file with ``WikiText2(download=False)`` on every worker.

The demo's ``Transformer.forward(inputs, target)`` lets each position attend the token it predicts
(the decoder reads ``target`` and the whole unmasked input), so the model here calls the same
layers with causal masks: a next-token model whose validation perplexity means what it says.

    python examples/transformer_lm.py [--devices 2] [--max-epochs 6]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos import Transformer, WikiText2
from torch import nn
from torch.utils.data import DataLoader, random_split

import lightning_monarch  # noqa: F401 - registers strategy="monarch"

DETERMINERS = {"singular": ("the", "a", "every", "one"), "plural": ("the", "some", "many", "two")}
ADJECTIVES = ("small", "big", "red", "old", "quick", "quiet")
NOUNS = {
    "singular": ("cat", "dog", "bird", "fox", "child", "robot"),
    "plural": ("cats", "dogs", "birds", "foxes", "children", "robots"),
}
VERBS = {
    "singular": ("sees", "likes", "follows", "chases", "finds"),
    "plural": ("see", "like", "follow", "chase", "find"),
}
PREPOSITIONS = ("near", "under", "behind", "with")
#: Every word the grammar uses; WikiText2 adds ``<eos>`` at the end of each line.
VOCABULARY = sorted(
    {".", *ADJECTIVES, *PREPOSITIONS}
    | {word for words in (*DETERMINERS.values(), *NOUNS.values(), *VERBS.values()) for word in words}
)


def noun_phrase(rng: random.Random) -> tuple[str, str]:
    """A determiner, maybe an adjective, and a noun that agree in number; and that number."""
    number = rng.choice(("singular", "plural"))
    words = [rng.choice(DETERMINERS[number])]
    if rng.random() < 0.5:
        words.append(rng.choice(ADJECTIVES))
    words.append(rng.choice(NOUNS[number]))
    return " ".join(words), number


def sentence(rng: random.Random) -> str:
    """Subject, verb (agreeing with the subject), object, maybe a prepositional phrase, and "."."""
    subject, number = noun_phrase(rng)
    words = [subject, rng.choice(VERBS[number]), noun_phrase(rng)[0]]
    if rng.random() < 0.3:
        words += [rng.choice(PREPOSITIONS), noun_phrase(rng)[0]]
    return " ".join(words + ["."])


def write_corpus(path: Path, sentences: int, seed: int = 0) -> None:
    """Write ``sentences`` generated sentences, a few per line, to ``path`` (atomically)."""
    rng = random.Random(seed)
    lines, left = [], sentences
    while left > 0:
        count = min(left, rng.randint(1, 3))
        lines.append(" ".join(sentence(rng) for _ in range(count)))
        left -= count
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text("\n".join(lines) + "\n", encoding="utf8")
    partial.replace(path)


class GeneratedTextDataModule(L.LightningDataModule):
    """A generated corpus read by ``lightning.pytorch.demos.WikiText2``, split 90/10."""

    def __init__(self, data_dir: str, sentences: int = 6000, block_size: int = 32, batch_size: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()

    @property
    def vocab_size(self) -> int:
        """The grammar's words and ``<eos>``: known before any worker reads the corpus."""
        return len(VOCABULARY) + 1

    def prepare_data(self) -> None:
        write_corpus(Path(self.hparams.data_dir) / "wikitext-2.txt", self.hparams.sentences)

    def setup(self, stage: str) -> None:
        dataset = WikiText2(Path(self.hparams.data_dir), block_size=self.hparams.block_size, download=False)
        validation = len(dataset) // 10
        self.train_set, self.val_set = random_split(
            dataset, [len(dataset) - validation, validation], generator=torch.Generator().manual_seed(0)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class CausalTransformer(Transformer):
    """The demo's Transformer as a next-token model: encoder, decoder and cross-attention all
    causally masked, so position ``i`` sees tokens ``0..i`` and predicts token ``i + 1``."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = self.generate_square_subsequent_mask(tokens.size(1)).to(tokens.device)
        embedded = self.pos_encoder(self.embedding(tokens) * math.sqrt(self.ninp))
        hidden = self.transformer(embedded, embedded, src_mask=mask, tgt_mask=mask, memory_mask=mask)
        return nn.functional.log_softmax(self.decoder(hidden), dim=-1)


class LanguageModel(L.LightningModule):
    """Next-token cross-entropy on the causal Transformer; ``val_loss`` is the log of perplexity."""

    def __init__(self, vocab_size: int, width: int = 64, heads: int = 2, layers: int = 2, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = CausalTransformer(vocab_size, ninp=width, nhead=heads, nhid=2 * width, nlayers=layers, dropout=0.1)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, target = batch
        return nn.functional.nll_loss(self.model(inputs).flatten(0, 1), target.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=6)
    parser.add_argument("--sentences", type=int, default=6000, help="sentences in the generated corpus")
    parser.add_argument(
        "--data-dir",
        default=os.path.join(tempfile.gettempdir(), "lightning_monarch_corpus"),
        help="where prepare_data writes wikitext-2.txt",
    )
    parser.add_argument("--default-root-dir", default=None, help="where logs and checkpoints go (default: here)")
    args = parser.parse_args()

    L.seed_everything(0)
    trainer = L.Trainer(
        strategy="monarch",
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.max_epochs,
        gradient_clip_val=0.5,
        default_root_dir=args.default_root_dir,
        log_every_n_steps=10,
    )
    datamodule = GeneratedTextDataModule(args.data_dir, sentences=args.sentences)
    trainer.fit(LanguageModel(datamodule.vocab_size), datamodule=datamodule)
    perplexity = math.exp(trainer.callback_metrics["val_loss"].item())
    print(f"Validation perplexity: {perplexity:.2f} (a uniform guess: {datamodule.vocab_size})")


if __name__ == "__main__":
    main()
