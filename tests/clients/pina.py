"""PINA (``pina-mathlab``, ``lightning.pytorch``): a physics-informed neural network solving the
Poisson equation on the unit square, as PINA's first tutorial trains one: a ``SpatialProblem``
with a domain-equation condition inside and a Dirichlet condition on the boundary, the domains
discretised on a grid, a ``FeedForward`` network, ``PhysicsInformedSingleModelSolver``, and PINA's
own ``Trainer`` (a subclass of Lightning's that builds the datamodule from the problem) with
``trainer.train()`` and ``trainer.test()``.

What it exercises: a library Trainer subclass that builds its own datamodule; conditions whose
class checks its arguments in ``__new__`` (PINA's ``InputEquationCondition``, which pickle writes
but cannot read back by itself); inputs that are ``LabelTensor`` (a tensor subclass with labels);
gradients of the network's output with respect to its inputs in ``training_step``
(``inference_mode=False``, which PINA's Trainer sets). The problem class is PINA's own, which the
workers import: PINA's data module, built by its Trainer in the script, moves the discretised points
into the class-level ``conditions``, which reach the workers with the stage (``imported_state``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning import pytorch as pl
from pina import Trainer
from pina.model import FeedForward
from pina.problem import SpatialProblem
from pina.problem.zoo import Poisson2DSquareProblem
from pina.solver import PhysicsInformedSingleModelSolver

import lightning_monarch  # noqa: F401 - registers strategy="monarch"
from tests.clients import quiet_trainer, results


def _poisson() -> SpatialProblem:
    """PINA's Poisson problem on the unit square, from its zoo, with its domains discretised on a
    grid as the tutorial discretises them."""
    problem = Poisson2DSquareProblem()
    problem.discretise_domain(n=12, mode="grid", domains="D")
    problem.discretise_domain(n=10, mode="grid", domains="boundary")
    return problem


def train(strategy: str, out_dir: Path) -> Optional[dict[str, Any]]:
    pl.seed_everything(0)
    problem = _poisson()
    model = FeedForward(input_dimensions=2, output_dimensions=1, inner_size=10, n_layers=2)
    solver = PhysicsInformedSingleModelSolver(problem=problem, model=model)
    trainer = Trainer(solver=solver, batch_size=8, **quiet_trainer(strategy, out_dir), max_epochs=2)
    trainer.train()
    return results(trainer, solver, out_dir)
