"""DeepSpeed's checkpoint files: found, verified and unpickled without DeepSpeed, running nothing.

A checkpoint DeepSpeed's ``engine.save_checkpoint`` wrote with ZeRO stage 1, 2
or 3 (one model-parallel rank) is a directory of ``torch.save`` files:

```
<save_dir>/latest                                           the tag, e.g. "global_step100"
<save_dir>/<tag>/mp_rank_00_model_states.pt                 stages 1-2: the whole module's state dict,
                                                            counters, LR schedule, param_shapes
<save_dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt
                                                            stage 3, one per rank: the same, the
                                                            module's parameters as empty placeholders
<save_dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt
                                                            rank r's partition of the fp32 master
                                                            and of the optimizer's states
```

:func:`find_files` recognises such a directory and names its files;
deepspeed_layout.py reads what they hold, deepspeed_load.py loads it into an engine.

[Note: DeepSpeed's pickles, read without DeepSpeed]
Besides torch's tensor rebuilders and storages, ``torch.Size`` and
``collections.OrderedDict``, the files DeepSpeed 0.19.8 writes reference
exactly three globals of DeepSpeed's (found with ``pickletools`` over files of
all three stages, fp32 and bf16): ``deepspeed.runtime.fp16.loss_scaler.LossScaler``
(``DynamicLossScaler`` for dynamic fp16 scaling) and
``deepspeed.runtime.zero.config.ZeroStageEnum`` in every optimizer file, and
``deepspeed.utils.tensor_fragment.fragment_address`` (``param_slice_mappings``)
in those of stages 1-2; stage 3's flat groups are tensors with a ``ds_id``
attribute (``torch._tensor._rebuild_from_type_v2``). DeepSpeed is not
installed here and nothing of it may run, so each of its names is mapped onto
an inert stand-in below, by name, for the length of one ``torch.load(...,
weights_only=True)`` (``torch.serialization.safe_globals`` with
``(stand-in, "qualified.name")`` pairs: torch's own allow-list mechanism, no
unpickler of ours). A stand-in is a plain record: the unpickler makes it with
``__new__`` and fills its ``__dict__`` from the pickled state (a loss scaler,
a fragment address), or calls it with one value (``ZeroStage``, an ``int``);
no method of it runs and no code of the file's choosing is called. Any other
global (``os.system``, a class of the script's) is refused by torch's
weights-only unpickler before it is called, as our own checkpoints are
(:class:`~zero.checkpoint.format.UnsafeCheckpointError`, naming the file and
the global); a script's own types in ``client_state`` can be allowed with
``torch.serialization.add_safe_globals`` as for our own checkpoints. (The
context changes torch's process-wide allow-list while it lasts: a weights-only
load in another thread meanwhile would accept the same inert stand-ins, and
nothing else.)

[Note: a DeepSpeed file's bytes are verified before it is read]
A ``torch.save`` file is a zip archive; each record (the pickle, each tensor's
storage) carries a CRC-32, which ``torch.load`` does not check: a flipped byte
in a tensor loads silently, a truncated file fails with ``OSError: Invalid
argument`` naming nothing. :func:`verify_archive` reads every record once
(through nvmeio's ``FastFileReader``) and checks its CRC, so a damaged file is
refused by name (:class:`~zero.checkpoint.format.CheckpointCorruptionError`)
before anything is loaded. Every file is verified by one rank (file ``i`` by
rank ``i % world_size``) and the load goes on only when all ranks agree.
The files are then loaded with ``mmap=True``: their tensors are views of a
mapping, and a rank reads only the ranges it takes (as pretrained_files.py
reads ``.bin`` files).
"""
from __future__ import annotations

import os
import pickle
import re
import zipfile
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from nvmeio import FastFileReader

from .format import CheckpointCorruptionError, unsafe_error

_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_ZERO3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_MODEL = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_EXPERT = re.compile(r"(expp_rank_\d+_mp_rank_\d+_optim_states|layer_\d+_expert_\d+_mp_rank_\d+_model_states)\.pt")
_PIPELINE = re.compile(r"layer_\d+-model_\d+-model_states\.pt")
_VERIFY_CHUNK = 8 << 20


# -- the stand-ins (see [Note: DeepSpeed's pickles, read without DeepSpeed]) ----------------------

class LossScalerRecord:
    """What a pickled ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` holds (``cur_scale``, ...)."""

    dynamic = False

    def field(self, name: str, default=None):
        return self.__dict__.get(name, default)


class DynamicLossScalerRecord(LossScalerRecord):
    """What a pickled ``DynamicLossScaler`` holds (``cur_scale``, ``cur_iter``, ``cur_hysteresis``, ...)."""

    dynamic = True


class ZeroStage(int):
    """``deepspeed.runtime.zero.config.ZeroStageEnum``: the stage number."""


class FragmentAddress:
    """``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``); not used."""


STAND_INS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerRecord,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScalerRecord,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}


# -- the files of a checkpoint -------------------------------------------------------------------

@dataclass(frozen=True)
class DeepSpeedFiles:
    """The files of one DeepSpeed ZeRO checkpoint directory (one model-parallel rank)."""

    directory: str
    optim: List[str]  # by data-parallel rank
    model: Optional[str]  # mp_rank_00_model_states.pt (stages 1-2)
    zero3_model: List[str]  # zero_pp_rank_<r>_mp_rank_00_model_states.pt by rank (stage 3)

    @property
    def all(self) -> List[str]:
        return self.optim + ([self.model] if self.model else []) + self.zero3_model


def is_deepspeed_checkpoint(checkpoint: str) -> bool:
    """Whether ``checkpoint`` (a tag's directory) holds DeepSpeed's files rather than ours."""
    try:
        names = os.listdir(checkpoint)
    except OSError:
        return False
    return any(_OPTIM.fullmatch(n) or _ZERO3_MODEL.fullmatch(n) or _MODEL.fullmatch(n) for n in names)


def _by_rank(found: Dict[int, str], what: str, checkpoint: str) -> List[str]:
    ranks = sorted(found)
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks)) if ranks else []
    if missing:
        raise FileNotFoundError(f"DeepSpeed checkpoint {checkpoint} is incomplete: the {what} file of rank "
                                f"{missing[0]} is missing (it has ranks {ranks})")
    return [found[r] for r in ranks]


def find_files(checkpoint: str) -> DeepSpeedFiles:
    """The files of the DeepSpeed checkpoint in ``checkpoint``; what this reader cannot load
    (tensor or pipeline parallel, experts, no ZeRO optimizer files) is refused, saying why."""
    names = sorted(os.listdir(checkpoint))
    optim: Dict[int, str] = {}
    zero3: Dict[int, str] = {}
    model = None
    for name in names:
        path = os.path.join(checkpoint, name)
        if _EXPERT.fullmatch(name):
            raise ValueError(f"{path}: DeepSpeed checkpoints of mixture-of-experts models are not supported")
        if _PIPELINE.fullmatch(name):
            raise ValueError(f"{path}: DeepSpeed checkpoints of pipeline-parallel models are not supported")
        for pattern in (_OPTIM, _ZERO3_MODEL, _MODEL):
            match = pattern.fullmatch(name)
            if match is None:
                continue
            if int(match.groups()[-1]) != 0:
                raise ValueError(f"{path}: a DeepSpeed checkpoint with tensor (model) parallelism is not "
                                 f"supported, only mp_rank_00")
            if pattern is _MODEL:
                model = path
            else:
                rank = int(match.groups()[-2])
                table = optim if pattern is _OPTIM else zero3
                if rank in table:
                    raise ValueError(f"DeepSpeed checkpoint {checkpoint} holds two files for rank {rank}: "
                                     f"{os.path.basename(table[rank])} and {name}")
                table[rank] = path
            break
    if not optim:
        raise ValueError(f"{checkpoint} is a DeepSpeed checkpoint without ZeRO optimizer files "
                         f"(zero_pp_rank_*_optim_states.pt): only checkpoints of ZeRO stages 1-3 can be loaded")
    return DeepSpeedFiles(checkpoint, _by_rank(optim, "optimizer", checkpoint), model,
                          _by_rank(zero3, "model states", checkpoint) if zero3 else [])


# -- reading one file ----------------------------------------------------------------------------

def _record_crc(raw: FastFileReader, info: zipfile.ZipInfo, chunk: memoryview) -> int:
    """The CRC-32 of a stored (uncompressed) record's bytes, read in ``chunk``-sized pieces."""
    header = bytearray(30)
    raw.seek(info.header_offset)
    if raw.readinto(header) != 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"record {info.filename!r} has no local header at {info.header_offset}")
    raw.seek(info.header_offset + 30 + int.from_bytes(header[26:28], "little")
             + int.from_bytes(header[28:30], "little"))
    crc, left = 0, info.file_size
    while left:
        got = raw.readinto(chunk[:min(left, len(chunk))])
        if not got:
            raise EOFError(f"record {info.filename!r} ends {left} bytes early")
        crc = zlib.crc32(chunk[:got], crc)
        left -= got
    return crc


def verify_archive(path: str) -> None:
    """Every record of the ``torch.save`` file ``path`` matches its CRC-32; else
    :class:`CheckpointCorruptionError` naming the file (see [Note: a DeepSpeed file's bytes are
    verified before it is read])."""
    size = os.path.getsize(path)
    try:
        with FastFileReader(path, buffer_size=min(_VERIFY_CHUNK, max(4096, size))) as raw:
            with zipfile.ZipFile(raw) as archive:
                infos = archive.infolist()
                chunk = memoryview(bytearray(min(_VERIFY_CHUNK, max((i.file_size for i in infos), default=0))))
                for info in infos:
                    if info.compress_type != zipfile.ZIP_STORED:  # torch.save stores; anything else, as zipfile reads it
                        with archive.open(info) as record:
                            while record.read(_VERIFY_CHUNK):
                                pass
                    elif _record_crc(raw, info, chunk) != info.CRC:
                        raise zipfile.BadZipFile(f"Bad CRC-32 for record {info.filename!r}")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, NotImplementedError) as error:
        raise CheckpointCorruptionError(f"DeepSpeed checkpoint file {path} ({size} bytes) is damaged or "
                                        f"not a torch.save file: {error}; nothing was loaded") from None


def load_file(path: str):
    """``torch.load(path, weights_only=True, mmap=True)`` with DeepSpeed's names mapped onto the
    stand-ins: nothing in the file runs (:class:`UnsafeCheckpointError` for anything else)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"DeepSpeed checkpoint file {path} is missing")
    allowed = [(stand_in, name) for name, stand_in in STAND_INS.items()]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        raise unsafe_error(path, error) from None
    except (RuntimeError, OSError, EOFError, ValueError) as error:
        raise CheckpointCorruptionError(f"DeepSpeed checkpoint file {path} cannot be read as a torch.save "
                                        f"file ({type(error).__name__}: {error}); nothing was loaded") from None
