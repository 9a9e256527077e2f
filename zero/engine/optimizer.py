"""ZeroOptimizer: the step on fp32 master partitions, one sub-group at a time.

The step, in order: zero the gradient slices nothing wrote since the last
step; for fp16, skip the step when the gradients are not finite (the loss
scaler lowers its scale); compute the global gradient norm across ranks;
scale the gradients once by ``clip_coef / loss_scale``; run the update per
sub-group; write the new values back to the parameter shards (cast to the
compute dtype) unless the shards are the master itself.

[Note: torch's fused Adam, and why results match plain PyTorch]
The update is ``torch._fused_adam_`` / ``torch._fused_adamw_``, the kernels
``torch.optim.Adam/AdamW(fused=True)`` call: on the CPU they run at memory
bandwidth, as fast as DeepSpeed's CPUAdam. They are elementwise, so
stepping a sub-group's flat views gives the same bits as stepping each
parameter separately. The gradient norm is taken as
``torch.nn.utils.clip_grad_norm_`` takes it (a norm per parameter, then the
norm of those norms) and the clip coefficient ``max_norm / (norm + 1e-6)``,
clamped to 1, is applied the same way; on one rank the whole step is
therefore bit-identical to plain PyTorch AdamW with ``fused=True``. On several
ranks a parameter may be split between two ranks: each rank takes the norm of
its pieces and the squares are summed across ranks.

[Note: a step that fails half way is finished, never half applied]
With NVMe offload a step does I/O between sub-groups (swap-ins, swap-outs,
parameter write-backs), and any of it can fail. The swappers never lose data
on a failure (a failed read leaves the file as it was, a failed write keeps
the new values in their buffer and is retried by the next write), so what a
failure leaves is a step applied to some sub-groups and not to others. The
step therefore remembers its clip coefficient and the sub-groups it has
updated (``_PendingStep``; a sub-group's Adam update does no I/O, so it is
done or not), and the next call of :meth:`ZeroOptimizer.step` finishes it:
updated sub-groups are only written back again, the others updated with the
kept gradients. The engine refuses forward, backward and saves meanwhile
(zero_engine.py), so no partly updated state is trained on or stored; a run
that retries reaches the same bits as one that never failed.

[Note: sub-groups stepped during backward]
With the optimizer on NVMe, a sub-group's gradient is complete long before
backward ends (units complete in reverse order, runtime/grad_stash.py). When the step
needs nothing global first (no gradient clipping, no dynamic fp16 loss scale:
both need the norm of the whole gradient before any update), the backward of
the micro-batch that ends an accumulation window steps each sub-group the
moment its gradient completes: its master and states are read (the next
expected sub-group's read already started), Adam runs on the gradient still in
memory, and the write is submitted without waiting. The gradient never goes to
NVMe and back (two passes over the gradient bytes saved), and the optimizer's
reads and writes run while backward computes the earlier layers, as in the
overlapped CPU optimizer of Fuyou/LoHan (Liao et al., 2024). The update is the
same elementwise kernel on the same values, so the bits are those of a step
after backward. ``engine.step()`` then steps only the sub-groups no gradient
reached (frozen parameters: zero gradient, as after backward). A failure half
way through such a backward leaves some sub-groups updated: the engine then
refuses further use and says to load the last checkpoint (zero_engine.py).
``offload_optimizer.step_in_backward: false`` turns it off.

A script's own torch optimizer (``zero_allow_untested_optimizer``) is rebuilt
over views of the master partition and stepped once for all sub-groups; it
must be elementwise (SGD, Adagrad, RMSprop, ...), since it only ever sees
this rank's slices of each parameter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.optim import Optimizer

from ..runtime.comm import Comm
from ..runtime.grad_reducer import GradReducer
from .loss_scaler import LossScaler
from ..stores.optimizer_store import FlatOptimizerStore, OptimizerStore
from ..stores.param_store import ParamStore
from ..stores.layouts import RankLayout, SubGroup

Range = Tuple[int, int]


@dataclass(frozen=True)
class AdamKind:
    decoupled_weight_decay: bool = True  # AdamW
    amsgrad: bool = False

    @property
    def state_names(self) -> Tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())


def merge_ranges(ranges: Sequence[Range]) -> List[Range]:
    out: List[Range] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


@dataclass
class _PendingStep:
    """A step under way: its coefficient, and the sub-groups it has updated."""

    coef: Optional[torch.Tensor]
    stepped: Set[int] = field(default_factory=set)
    in_backward: bool = False  # begun by the backward that ends the window
    awaiting_step: bool = False  # that backward returned; engine.step() finishes it


def step_in_backward_blocker(clip: float, dynamic_scale: bool, adam: Optional[AdamKind],
                             torch_optimizer: bool) -> Optional[str]:
    """Why an optimizer made so cannot step sub-groups during backward, or None if it can."""
    if torch_optimizer or adam is None:
        return "the optimizer is not the config's Adam/AdamW"
    if clip > 0:
        return "gradient_clipping needs the global gradient norm before any update"
    if dynamic_scale:
        return "the dynamic fp16 loss scale needs an overflow check before any update"
    return None


def sub_group_ranges(rank_layout: RankLayout, group_ranges: List[List[Range]]) -> Dict[int, List[List[Range]]]:
    """Per sub-group, per param group: the parameter pieces inside it (a piece never straddles two
    sub-groups: sub-groups are whole unit shards)."""
    return {sg.index: [[(a, b) for a, b in ranges if sg.start <= a < sg.stop] for ranges in group_ranges]
            for sg in rank_layout.sub_groups}


def stash_norm_ranges(rank_layout: RankLayout, group_ranges: List[List[Range]]) -> Dict[int, List[Range]]:
    """Per sub-group, every parameter piece whose gradient norm a step takes (GradStash takes them
    as the gradients go to NVMe: [Note: the global norm is taken on the way out])."""
    return {i: [r for ranges in per_group for r in ranges]
            for i, per_group in sub_group_ranges(rank_layout, group_ranges).items()}


class ZeroOptimizer(Optimizer):
    """The optimizer :func:`zero.initialize` returns; ``param_groups`` drive LR schedulers.

    ``group_ranges[g]``: rank-space ranges of the parameters of group ``g``
    (one per parameter piece); ``hyper[g]``: that group's settings.
    """

    def __init__(self, rank_layout: RankLayout, store: OptimizerStore, param_store: ParamStore,
                 reducer: GradReducer, comm: Comm, hyper: List[dict], group_ranges: List[List[Range]],
                 clip: float, scaler: LossScaler, adam: Optional[AdamKind], torch_optimizer_type=None,
                 torch_defaults: Optional[dict] = None):
        defaults = dict(hyper[0]) if hyper else {}
        super().__init__([dict(h, params=[]) for h in hyper], defaults)
        self.rank_layout = rank_layout
        self.store = store
        self.param_store = param_store
        self.reducer = reducer
        self.comm = comm
        self.clip = float(clip)
        self.scaler = scaler
        self.adam = adam
        self.adam_step = 0
        self._scalars: Dict[tuple, tuple] = {}  # (name, device) -> (what it is of, the scalar there)
        self.skipped_steps = 0
        self.global_grad_norm: Optional[float] = None
        self._pending: Optional[_PendingStep] = None
        self._group_ranges = group_ranges
        self._norm_ranges = sorted(r for ranges in group_ranges for r in ranges)
        self._sg_ranges = sub_group_ranges(rank_layout, group_ranges)
        # Units with a trainable piece on this rank: a step changes no other unit's master.
        unit_ranges = [rank_layout.unit_range(u.index) for u in rank_layout.units]
        self._stepped_units = {u.index for u, (lo, hi) in zip(rank_layout.units, unit_ranges)
                               if any(lo <= a < hi for a, _ in self._norm_ranges)}
        # A step on the GPU is ordered by its stream; one on the host must wait for the copies (step())
        self._steps_on_host = not (isinstance(store, FlatOptimizerStore) and store.master.device.type == "cuda")
        self.inner: Optional[Optimizer] = None
        if torch_optimizer_type is not None:
            reducer.hold = False  # the torch optimizer reads .grad views of the flat partition
            self.inner = self._build_inner(torch_optimizer_type, torch_defaults or {}, group_ranges)

    def add_param_group(self, param_group: dict) -> None:
        # torch's is wrapped in torch._disable_dynamo, whose first call imports torch._dynamo: 2.3 s
        # of every process that builds an engine (each rank, each launch), for a call dynamo never
        # traces. The method itself, unwrapped, does the same checks.
        add = Optimizer.add_param_group
        getattr(add, "__wrapped__", add)(self, param_group)

    # -- DeepSpeed-compatible attributes -----------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.loss_scale

    cur_scale = loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are consumed by each step; nothing to clear."""

    # -- the step ----------------------------------------------------------------------------------
    @property
    def step_in_progress(self) -> bool:
        """A step raised half way (an I/O error): :meth:`step` finishes it (see the [Note] above)."""
        return self._pending is not None and not self._pending.awaiting_step

    def step_progress(self) -> Tuple[int, int]:
        """(sub-groups updated, sub-groups) of the step in progress."""
        stepped = len(self._pending.stepped) if self._pending is not None else 0
        return stepped, len(self.rank_layout.trainable_sub_groups)

    def abandon_step(self) -> None:
        """Forget a step in progress (load_checkpoint replaces the whole state)."""
        self._pending = None

    # -- the step during backward (see [Note: sub-groups stepped during backward]) ---------------
    def why_not_step_in_backward(self) -> Optional[str]:
        """Why steps cannot run during backward with this configuration, or None if they can."""
        if not self.reducer.stash.on_nvme or not self.store.steps_in_backward:
            return "offload_optimizer.device is not nvme"
        return step_in_backward_blocker(self.clip, self.scaler.dynamic, self.adam, self.inner is not None)

    def can_step_in_backward(self) -> bool:
        """Whether this window's step needs nothing global before its first update."""
        return self._pending is None and self.why_not_step_in_backward() is None

    def begin_step_in_backward(self) -> None:
        """The backward about to run ends a window: step each sub-group as its gradient completes."""
        coef = self._prepare()  # no norm is needed: only the static loss scale
        self._pending = _PendingStep(coef, in_backward=True)
        self.adam_step += 1
        self.reducer.stash.begin_steps(self._step_completed)
        self.store.begin_backward_step()

    def end_backward(self) -> None:
        """Backward returned: the sub-groups no gradient reached are stepped by :meth:`step`."""
        self.reducer.stash.end_steps()
        if self._pending is not None and self._pending.in_backward:
            self._pending.awaiting_step = True

    def abandon_backward_step(self) -> int:
        """Backward failed half way: the number of sub-groups its step had updated (then the
        state is partly updated and only a checkpoint restores it); with none, the step is
        forgotten as if it never began."""
        self.reducer.stash.end_steps()
        pending = self._pending
        if pending is None or not pending.in_backward:
            return 0
        self.store.abandon_backward_step()
        if not pending.stepped:
            self._pending = None
            self.adam_step -= 1
        return len(pending.stepped)

    @torch.no_grad()
    def _step_completed(self, sg: SubGroup, grad: torch.Tensor) -> None:
        pending = self._pending
        if sg.numel:
            self.store.step_in_backward(
                sg, lambda sg_, master, states, _: self._step_sub_group(sg_, master, states, grad, pending), grad)
        pending.stepped.add(sg.index)

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """One optimizer step; returns False when it was skipped for an fp16 overflow.

        After a step that raised half way, the next call finishes that step (same gradients,
        same clip coefficient; sub-groups updated already are only written back again)."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure; call engine.step()")
        if self._steps_on_host and torch.cuda.is_initialized():
            # copies in flight to and from pinned host memory are done (the master stepped in place
            # below was the source of the last write-back: runtime/write_back.py [Note])
            torch.cuda.synchronize()
        if self._pending is None:
            coef = self._prepare()
            if coef is False:
                return False
            self._pending = _PendingStep(coef)
            if self.inner is None:
                self.adam_step += 1
        pending = self._pending
        pending.awaiting_step = False  # from here a failure is a step failure (engine.step retries)
        if self.inner is not None:
            self._step_inner(pending)
        else:
            # Sub-groups stepped during backward are done (their writes are in flight).
            done = pending.stepped if pending.in_backward else frozenset()
            self.store.step(lambda sg, master, states, grad: self._step_sub_group(sg, master, states, grad, pending),
                            skip=set(done))
        self._pending = None
        self.reducer.clear()
        self.scaler.update(False)
        return True

    def _prepare(self):
        """The clip/unscale coefficient of this step (None: none), or False for an fp16 overflow."""
        self.reducer.zero_stale()
        scale = self.scaler.loss_scale
        norm = None
        if self.clip > 0 or self.scaler.dynamic:
            norm = self._global_norm()
            overflow = not math.isfinite(float(norm))
            if self.scaler.dynamic and overflow:
                self.global_grad_norm = None
                self.reducer.clear(consumed=False)
                self.skipped_steps += 1
                self.last_overflow_message = self.scaler.update(True)
                return False
            self.global_grad_norm = float(norm) / scale
        coef = None
        if self.clip > 0:
            clip_coef = self.clip / (norm / scale + 1e-6)
            coef = torch.clamp(clip_coef, max=1.0)
            if scale != 1.0:
                coef = coef / scale
        elif scale != 1.0:
            coef = torch.tensor(1.0 / scale)
        return coef

    def _global_norm(self) -> torch.Tensor:
        norms = [self.reducer.norm(a, b) for a, b in self._norm_ranges]
        total = (torch.linalg.vector_norm(torch.stack(norms)) if norms
                 else torch.zeros((), device=self.store.grads.device if self.store.grads is not None else "cpu"))
        if self.comm.distributed:
            squared = (total.double() ** 2).reshape(1)
            self.comm.all_reduce(squared)
            total = squared.sqrt().to(torch.float32).reshape(())
        return total

    def _step_sub_group(self, sg: SubGroup, master: torch.Tensor, states: Dict[str, torch.Tensor],
                        grad: torch.Tensor, pending: "_PendingStep") -> None:
        """Adam on one sub-group (unless this step updated it already), then its parameter shards
        written back; ``grad`` (the store's flat view) is read through the reducer, which may hold
        some parameters' gradients as separate tensors."""
        if sg.index not in pending.stepped:
            self._adam(sg, master, states, grad, pending.coef)
            pending.stepped.add(sg.index)  # no I/O since the gradients were scaled: all or nothing
        self._write_back(sg, master)

    def _adam(self, sg: SubGroup, master: torch.Tensor, states: Dict[str, torch.Tensor], grad: torch.Tensor,
              coef: Optional[torch.Tensor]) -> None:
        step = self._scalar_on(master.device, "step", self.adam_step, lambda: torch.tensor(float(self.adam_step)))
        kernel = torch._fused_adamw_ if self.adam.decoupled_weight_decay else torch._fused_adam_
        for group, ranges in zip(self.param_groups, self._sg_ranges[sg.index]):
            if not ranges:
                continue
            if self.reducer.stash.on_nvme:
                grad = self.reducer.stash.step_grad(grad, sg)
                grads = [grad[a - sg.start:b - sg.start] for a, b in ranges]
            else:
                grads = [self.reducer.grad(a, b) for a, b in ranges]
            if coef is not None:
                torch._foreach_mul_(grads, self._scalar_on(grads[0].device, "coef", coef, lambda: coef))
            views = lambda t: [t[a - sg.start:b - sg.start] for a, b in ranges]
            beta1, beta2 = group["betas"]
            kernel(views(master), grads, views(states["exp_avg"]), views(states["exp_avg_sq"]),
                   views(states["max_exp_avg_sq"]) if self.adam.amsgrad else [], [step] * len(ranges),
                   lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                   weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                   amsgrad=self.adam.amsgrad, maximize=False)

    def _scalar_on(self, device: torch.device, name: str, of, make) -> torch.Tensor:
        """``make()``, a scalar of this step, on ``device``: copied there once per ``of`` (the step
        number, the coefficient tensor), not once per sub-group, where a copy from pageable host
        memory synchronizes the stream each time."""
        held = self._scalars.get((name, device))
        if held is None or not (held[0] is of or (isinstance(of, int) and held[0] == of)):
            held = self._scalars[name, device] = (of, make().to(device))
        return held[1]

    def _write_back(self, sg: SubGroup, master: torch.Tensor) -> None:
        """The sub-group's parameter shards from its master; a unit the step cannot change (frozen:
        no trainable piece on this rank) is not written again (a LoRA base is not rewritten each step)."""
        for unit_index in sg.units:
            start, stop = self.rank_layout.unit_range(unit_index)
            values, layout = master[start - sg.start:stop - sg.start], self.rank_layout.units[unit_index]
            if unit_index in self._stepped_units:
                self.param_store.write(layout, values)
            else:
                self.param_store.keep_unchanged(layout, values)

    # -- a script's own torch optimizer --------------------------------------------------------------
    def _build_inner(self, optimizer_type, defaults: dict, group_ranges: List[List[Range]]) -> Optimizer:
        if not isinstance(self.store, FlatOptimizerStore):
            raise ValueError("a script's own optimizer needs offload_optimizer device none or cpu; "
                             "for nvme use the config's optimizer section (Adam or AdamW)")
        master, grads = self.store.master, self.store.grads
        groups = []
        for group, ranges in zip(self.param_groups, group_ranges):
            views = []
            for a, b in merge_ranges(ranges):
                v = master[a:b]
                v.grad = grads[a:b]
                views.append(v)
            groups.append(dict({k: v for k, v in group.items() if k != "params"}, params=views))
        groups = [g for g in groups if g["params"]]
        return optimizer_type(groups, **defaults)

    def _step_inner(self, pending: "_PendingStep") -> None:
        if not pending.stepped:
            if pending.coef is not None:
                self.store.grads.mul_(pending.coef.to(self.store.grads.device))
            inner_groups = iter(self.inner.param_groups)
            for group, ranges in zip(self.param_groups, self._group_ranges):
                if ranges:
                    inner = next(inner_groups)
                    inner.update({k: v for k, v in group.items() if k != "params"})
            self.inner.step()
            pending.stepped.update(sg.index for sg in self.rank_layout.trainable_sub_groups)
        for sg in self.rank_layout.trainable_sub_groups:
            self._write_back(sg, self.store.master[sg.start:sg.stop])

    # -- checkpoints ---------------------------------------------------------------------------------
    def hyper_state(self) -> dict:
        """What a checkpoint keeps besides the partitions: settings, step count, scaler."""
        state = {
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "adam_step": self.adam_step,
            "skipped_steps": self.skipped_steps,
            "loss_scaler": self.scaler.state_dict(),
        }
        if self.inner is not None:
            state["inner"] = self.inner.state_dict()
        return state

    def load_hyper_state(self, state: dict) -> None:
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        self.adam_step = int(state["adam_step"])
        self.skipped_steps = int(state["skipped_steps"])
        self.scaler.load_state_dict(state["loss_scaler"])
        if self.inner is not None and "inner" in state:
            self.inner.load_state_dict(state["inner"])
