import lightning as L, lightning_monarch
from tests.models import Classifier
class P(Classifier):
    def on_train_epoch_start(self):
        print(f"hello from a worker, epoch {self.current_epoch}", flush=True)
L.Trainer(strategy="monarch", accelerator="cpu", devices=2, max_epochs=2, limit_train_batches=2, limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(P())
print("CONTROLLER DONE")
