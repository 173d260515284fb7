"""A text project's stage for ``benchmarks.script_state``: a datamodule holding a corpus.

Imported by the benchmark and, by module path, by the workers that open its stage (its classes
travel by reference, so that a class attribute the script changed is carried as a library's is).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Corpus(Dataset):
    """200,000 sentences of 12 words and their vocabulary, held as Python objects; ``lowercase``
    is its tokenizer's setting, a class attribute a script may change."""

    lowercase = False

    def __init__(self, sentences: int = 200_000) -> None:
        words = [f"Word{index}" for index in range(5_000)]
        self.sentences = [
            " ".join(words[(line * 7 + step) % len(words)] for step in range(12)) for line in range(sentences)
        ]
        self.vocabulary = {word.lower() if self.lowercase else word: index for index, word in enumerate(words)}

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> Any:
        words = self.sentences[index].split()
        tokens = [self.vocabulary.get(word.lower() if self.lowercase else word, 0) for word in words]
        return torch.tensor(tokens[:8], dtype=torch.float32), torch.tensor(index % 10)


class CorpusData(L.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.corpus = Corpus()

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.corpus, batch_size=8)


class CorpusModel(L.LightningModule):
    """A linear classifier of the corpus's first 8 tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 10)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)
