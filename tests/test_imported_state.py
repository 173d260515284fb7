"""What the script changed in the classes and modules a stage refers to reaches the workers
(``controller.mesh.imported_state``, ``worker.imported_state``); the parity cases
``script_class_attribute`` and ``script_module_setting``, PINA's and scvi-tools' runs in the client
tier compare whole runs with ``ddp``."""

from __future__ import annotations

import threading

import lightning as L
import pytest

from lightning_monarch import WorkerError
from lightning_monarch.controller.mesh.imported_state import data_attributes, gather, public_settings
from lightning_monarch.controller.mesh.payload import travel_error
from lightning_monarch.wire.specs import ImportedState, Untravelled
from lightning_monarch.worker.imported_state import CarriedState
from tests import compat_models as compat

pytestmark = pytest.mark.timeout(120)


class Settings:
    """A library's settings object: a property with a setter, one without, one without a getter,
    public and private data."""

    def __init__(self) -> None:
        self._seed = 0
        self.verbose = False
        self._cache: dict[str, int] = {}

    @property
    def seed(self) -> int:
        return self._seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._seed = value

    @property
    def version(self) -> str:
        return "1.0"

    def _set_token(self, value: str) -> None:
        self._cache["token"] = len(value)

    #: Write-only: nothing to read, so nothing to carry.
    token = property(fset=_set_token)


def test_data_attributes_leave_out_code_and_pythons_own() -> None:
    assert data_attributes(compat.ScaledClassifier) == {"scale": 1.0}
    assert public_settings(Settings()) == {"verbose": False, "seed": 0}


def test_a_value_that_cannot_be_pickled_travels_as_its_type_and_the_workers_refuse_another() -> None:
    lock = threading.Lock()
    compat.ScaledClassifier.scale = lock  # type: ignore[assignment]
    try:
        state = gather([compat.ScaledClassifier], [], travel_error)
        assert compat.ScaledClassifier not in state.attributes
        assert state.untravelled[compat.ScaledClassifier]["scale"][0] == Untravelled("_thread.lock")
        trainer = L.Trainer(
            strategy="monarch",
            accelerator="cpu",
            devices=2,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with pytest.raises(
            WorkerError,
            match=r"`tests.compat_models.ScaledClassifier.scale` on the controller to a `_thread.lock`.*"
            r"their import holds a `builtins.float` there.*`setup`",
        ):
            trainer.fit(compat.ScaledClassifier())
    finally:
        compat.ScaledClassifier.scale = 1.0


class Registry:
    """A library's class whose data holds something that cannot be pickled beside data."""

    handlers: dict[str, object] = {"lock": threading.Lock(), "retries": 3}


@pytest.mark.parametrize(
    ("script", "refused"),
    [
        ({"lock": threading.Lock(), "retries": 3}, False),  # the same data: another lock cannot be told apart
        ({"lock": threading.Lock(), "retries": 5}, True),
        ({"lock": threading.Lock(), "retries": 3, "extra": 1}, True),
        ([threading.Lock(), 3], True),
    ],
)
def test_a_value_that_cannot_be_pickled_is_told_apart_by_its_data(script: object, refused: bool) -> None:
    """A dict that holds a lock cannot travel; its description (the lock's type, the data beside
    it) tells a worker whose import holds other data that the script changed it."""
    imported = Registry.handlers
    Registry.handlers = script  # type: ignore[assignment]
    try:
        state = gather([Registry], [], travel_error)
    finally:
        Registry.handlers = imported
    assert Registry not in state.attributes
    if refused:
        with pytest.raises(TypeError, match=r"Registry.handlers` on the controller to a `builtins"):
            CarriedState(ImportedState({}, {}, state.untravelled))
    else:
        CarriedState(ImportedState({}, {}, state.untravelled)).undo()


#: A library's settings object, held by a module the stage refers to.
LIBRARY_SETTINGS = Settings()


def test_a_setting_that_cannot_be_pickled_is_refused_where_the_import_differs() -> None:
    LIBRARY_SETTINGS.verbose = threading.Lock()  # type: ignore[assignment]
    try:
        state = gather([], [__name__], travel_error)
    finally:
        LIBRARY_SETTINGS.verbose = False
    key = (__name__, "LIBRARY_SETTINGS")
    assert "verbose" not in state.settings[key] and state.untravelled[key]["verbose"][0] == Untravelled("_thread.lock")
    with pytest.raises(TypeError, match=r"`tests.test_imported_state.LIBRARY_SETTINGS.verbose` on the controller to a"):
        CarriedState(ImportedState({}, {}, state.untravelled))
