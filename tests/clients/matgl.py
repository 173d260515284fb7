"""matgl (``matgl``, ``lightning.pytorch``): a structure-wise property model as matgl's MEGNet
formation-energy tutorial trains one: pymatgen ``Structure``s turned into graphs by matgl's own
``Structure2Graph`` (with ``get_element_list``) in an ``MGLDataset``, ``split_dataset``, then
``MGLDataLoader`` with its defaults (its collate function picked from the labels, and its pool of
persistent DataLoader worker processes), a ``MEGNet`` with its own bond expansion, matgl's
``ModelLightningModule`` (Adam, cosine annealing, torchmetrics MAE and RMSE) and Lightning's
``Trainer`` with ``trainer.fit(train_dataloaders=..., val_dataloaders=...)``. The structures are
small seeded cubic cells made here, with a made-up target; nothing is downloaded.

What it exercises: DataLoader worker processes that each rank starts itself (``MGLDataLoader``
gives ``num_workers=min(4, os.cpu_count())`` and ``persistent_workers=True`` unless told otherwise),
started with the start method a ``ddp`` rank's would have: the 60 cells are about 300 tensors (four
in each graph, and its lattice), more file descriptors than a forkserver's one message can pass
("too many fds"); batches of PyG graphs with lattices and state attributes; a library module that
keeps a ``torch.nn.functional`` loss as an attribute.

The dataset is built with ``save_cache=False``: under ``ddp`` every rank runs the script and builds
it, and two ranks writing matgl's cache files into the same directory and reading them back would
race. What PyG's ``Dataset`` writes itself goes under ``out_dir``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
from lightning import pytorch as pl
from matgl.ext.pymatgen import Structure2Graph, get_element_list
from matgl.graph.data import MGLDataLoader, MGLDataset, split_dataset
from matgl.models import MEGNet
from matgl.utils.training import ModelLightningModule
from pymatgen.core import Lattice, Structure

import lightning_monarch  # noqa: F401 - registers strategy="monarch"
from tests.clients import quiet_trainer, results

#: The elements of the made-up cells, with the made-up per-atom energy each contributes.
ENERGIES = {"Li": -1.9, "Na": -1.3, "Mg": -1.6, "O": -4.9, "F": -1.9, "Cl": -1.8}


def _structures(count: int = 60) -> tuple[list[Structure], list[float]]:
    """``count`` seeded cubic cells of 2 to 4 atoms, and a formation-energy-like target for each:
    the mean of its atoms' made-up energies, less a term in the cell's density, plus noise."""
    rng = np.random.default_rng(0)
    structures, targets = [], []
    for _ in range(count):
        atoms = int(rng.integers(2, 5))
        species = list(rng.choice(sorted(ENERGIES), size=atoms))
        structure = Structure(Lattice.cubic(float(rng.uniform(3.2, 4.4))), species, rng.uniform(0, 1, (atoms, 3)))
        structures.append(structure)
        energy = np.mean([ENERGIES[element] for element in species]) - 0.5 * atoms / structure.volume
        targets.append(float(energy + rng.normal() * 0.05))
    return structures, targets


def train(strategy: str, out_dir: Path) -> Optional[dict[str, Any]]:
    pl.seed_everything(0)
    structures, eform = _structures()
    elements = get_element_list(structures)
    converter = Structure2Graph(element_types=elements, cutoff=4.0)
    dataset = MGLDataset(
        structures=structures,
        labels={"eform": eform},
        converter=converter,
        root=str(out_dir / "MGLDataset"),
        save_cache=False,
    )
    train_data, val_data, _ = split_dataset(dataset, frac_list=[0.8, 0.2, 0.0], shuffle=True, random_state=42)
    train_loader, val_loader = MGLDataLoader(train_data=train_data, val_data=val_data, batch_size=8)
    model = MEGNet(
        dim_node_embedding=8,
        dim_edge_embedding=16,
        dim_state_embedding=2,
        nblocks=2,
        hidden_layer_sizes_input=(16, 8),
        hidden_layer_sizes_conv=(16, 16, 8),
        hidden_layer_sizes_output=(8, 4),
        nlayers_set2set=1,
        niters_set2set=2,
        activation_type="softplus2",
        element_types=elements,
        cutoff=4.0,
        gauss_width=0.5,
    )
    module = ModelLightningModule(model=model, lr=0.01)
    trainer = pl.Trainer(**quiet_trainer(strategy, out_dir), max_epochs=2, log_every_n_steps=1)
    trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=val_loader)
    return results(trainer, module, out_dir)
