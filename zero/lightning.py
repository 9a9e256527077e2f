"""Lightning on this engine (``pip install "nvmeio[lightning]"``)::

    import zero.lightning                       # registers the strategy names
    trainer = Trainer(strategy="zero_stage_3_offload", precision="bf16-mixed")
    zero.lightning.convert_zero_checkpoint_to_fp32_state_dict("epoch=0-step=100.ckpt", "model.ckpt")

The implementation and its notes are in :mod:`zero.integrations.lightning_strategy`."""

from .integrations.lightning_checkpoints import convert_zero_checkpoint_to_fp32_state_dict
from .integrations.lightning_precision import ZeroPrecision
from .integrations.lightning_strategy import ZeroStrategy

__all__ = ["ZeroPrecision", "ZeroStrategy", "convert_zero_checkpoint_to_fp32_state_dict"]
