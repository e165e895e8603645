"""optirs.torch.Muon: ``torch.optim.Muon`` (Newton-Schulz orthogonalised momentum for 2-D weights).

A step per param group, as torch's (torch/optim/_muon.py)::

    B <- lerp(B, g, 1 - momentum)                          the momentum buffer
    U <- lerp(g, B, momentum) if nesterov else B
    O <- NS(U)                                             Newton-Schulz, in bfloat16, through torch's matmul
    p <- p * (1 - lr * weight_decay) - adjust_lr(lr, p.shape) * O

The elementwise parts are optirs steps of the SGD definition, one launch per (group, dtype, step
format), with every step format (``state_dtype="bfloat16"`` / ``"int8"`` momentum):

- the momentum: an SGD step with ``momentum = dampening = momentum`` (so ``B`` is torch's lerp:
  ``momentum * B + (1 - momentum) * g``, from a zero buffer) over a scratch tensor ``Z`` per
  parameter that it leaves holding ``-U``: ``Z = 0`` and ``lr = 1`` without Nesterov (``Z - B``),
  ``Z = -(1 - momentum) * g`` and ``lr = momentum`` with it;
- the orthogonalisation of ``Z``: NS is odd, so it is ``-O``; torch's matmul (bfloat16 on a GPU's
  tensor cores, as torch);
- the update: an SGD step with ``maximize=True`` over the parameters with ``-O`` as gradient,
  ``lr = adjust_lr(lr, shape)`` and ``weight_decay = lr * weight_decay / adjust_lr(lr, shape)``
  (torch's L2 form ``p - lr' * (-(-O) + wd' * p)``): one launch per group and shape ratio.

``opt.state[p]`` holds the momentum step's state under torch's key (``momentum_buffer``, or its
compact keys), so ``state_dict()`` loads into ``torch.optim.Muon`` and back.

DTensor parameters (FSDP2, tensor parallel): the elementwise steps run on the local shards (see
optirs.torch._dtensor); NS needs the whole matrix, so each parameter's ``-U`` is gathered
(``full_tensor()``: an all-gather per parameter, as Moonlight's distributed Muon does), every rank
orthogonalises it and keeps its own shard of the result.

Each group's step is two optirs transactions: a group refused by the momentum step's checks is
left as it was (groups before it have stepped, as with torch); the update steps the same tensors
with gradients made here, whose checks it passes.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.torch._dtensor import is_dtensor, local
from optirs.torch._scratch import hand_over, scratch_for
from optirs.torch._state import TrackedState
from optirs.torch.optimizers import SGD

# torch.optim.Muon's defaults (torch/optim/_muon.py)
EPS = 1e-7
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
_FORMAT_KEYS = ("state_dtype", "stochastic_rounding", "seed")


def zeropower_via_newtonschulz(u: torch.Tensor, coefficients: Tuple[float, float, float], steps: int,
                               eps: float) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of a 2-D tensor: ``steps`` quintic Newton-Schulz
    iterations in bfloat16 after dividing by the Frobenius norm (clamped at ``eps``), on the
    transpose of a tall matrix; returns bfloat16."""
    a, b, c = coefficients
    x = u.bfloat16()
    tall = u.size(0) > u.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_ratio(adjust_lr_fn: Optional[str], shape: Tuple[int, ...]) -> float:
    """``adjust_lr(lr, shape) / lr`` as torch.optim.Muon: ``sqrt(max(1, A / B))`` ("original",
    the default), ``0.2 * sqrt(max(A, B))`` ("match_rms_adamw")."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def _check_matrix(p: Any, where: str) -> None:
    if not isinstance(p, torch.Tensor) or p.dim() != 2:
        shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
        raise ShapeMismatchError(
            f"{where} has shape {shape}, expected a 2-D parameter: Muon orthogonalises matrices (as torch.optim.Muon); "
            "optimize embeddings, heads, biases and norms with an AdamW group or optimizer (docs/torch.md)")
    if p.is_complex():
        raise UnsupportedOperationError(f"{where} is {p.dtype}, expected a real tensor (as torch.optim.Muon)")


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon on optirs' SGD kernels with torch's Newton-Schulz (module docstring).

    Takes torch 2.13's arguments plus the step-format keywords ``state_dtype`` (the momentum's:
    ``"float32"``, ``"bfloat16"``, ``"int8"``), ``stochastic_rounding``, ``seed``, and ``backend`` /
    ``backend_options``."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: Tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = EPS, ns_steps: int = NS_STEPS, adjust_lr_fn: Optional[str] = None, *,
                 state_dtype: str = "float32", stochastic_rounding: bool = False, seed: int = 0,
                 backend: str = "auto", backend_options: Optional[Dict[str, Any]] = None):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        state_dtype=state_dtype, stochastic_rounding=stochastic_rounding, seed=seed)
        self._check_values(defaults, "Muon")
        self._backend, self._backend_options = backend, backend_options
        self._inner: Dict[int, Tuple[SGD, SGD]] = {}  # per group: (momentum step, update step)
        self._scratch: Dict[int, torch.Tensor] = {}  # id(p) -> Z
        self._alias: Dict[int, torch.Tensor] = {}  # id(p) -> p.detach() (the update step's parameter)
        super().__init__(params, defaults)
        self.state = TrackedState(self.state)

    @staticmethod
    def _check_values(group: Dict[str, Any], where: str) -> None:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise InvalidParameterError(f"{where}: lr is a tensor of {lr.numel()} elements, expected 1 element")
            lr = float(lr.item())
        for name, value in (("lr", lr), ("momentum", group["momentum"]), ("weight_decay", group["weight_decay"])):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.0:
                raise InvalidParameterError(f"{where}: {name}={value!r}, expected a number >= 0")
        if not group["momentum"] < 1.0:
            raise InvalidParameterError(f"{where}: momentum={group['momentum']!r}, expected momentum < 1 (the "
                                        "buffer is a moving average: lerp(B, g, 1 - momentum))")
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise InvalidParameterError(
                f"{where}: adjust_lr_fn={group['adjust_lr_fn']!r}, expected one of {list(ADJUST_LR_FNS)}")
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
            raise InvalidParameterError(f"{where}: ns_steps={steps!r}, expected an int 0 <= ns_steps < 100")
        coefficients = group["ns_coefficients"]
        if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3 or not all(
                isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in coefficients):
            raise InvalidParameterError(f"{where}: ns_coefficients={coefficients!r}, expected 3 finite numbers")
        if not isinstance(group["eps"], (int, float)) or not group["eps"] > 0:
            raise InvalidParameterError(f"{where}: eps={group['eps']!r}, expected a number > 0")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        where = f"param_groups[{len(self.param_groups)}]"
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for j, p in enumerate(params):
            _check_matrix(p, f"{where}['params'][{j}]")
        self._check_values({**self.defaults, **param_group}, where)
        super().add_param_group(param_group)

    # ------------------------------------------------------------ the inner steps

    def _inners(self, gi: int, group: Dict[str, Any]) -> Tuple[SGD, SGD]:
        """The group's momentum and update optimizers (made at its first step, or again when its
        parameter list or format changed)."""
        key = (tuple(map(id, group["params"])), tuple(group.get(k) for k in _FORMAT_KEYS))
        held = self._inner.get(gi)
        if held is not None and held[2] == key:
            return held[0], held[1]
        formats = {k: group.get(k, self.defaults[k]) for k in _FORMAT_KEYS}  # (absent from torch's checkpoints)
        scratch = [scratch_for(self._scratch, p) for p in group["params"]]
        momentum = SGD(scratch, lr=1.0, momentum=group["momentum"], dampening=group["momentum"],
                       backend=self._backend, backend_options=self._backend_options, **formats)
        # the update: one group per adjusted-lr ratio (its scalars are per launch)
        by_ratio: Dict[float, List[torch.Tensor]] = {}
        for p in group["params"]:
            by_ratio.setdefault(adjusted_ratio(group["adjust_lr_fn"], tuple(p.shape)), []).append(self._alias_of(p))
        groups = [{"params": ps, "ratio": r} for r, ps in by_ratio.items()]
        update = SGD(groups, lr=0.0, maximize=True, backend=self._backend, backend_options=self._backend_options)
        self._inner[gi] = (momentum, update, key)  # type: ignore[assignment]
        return momentum, update

    def _alias_of(self, p: torch.Tensor) -> torch.Tensor:
        a = self._alias.get(id(p))
        if a is None or local(a).data_ptr() != local(p).data_ptr() or a.shape != p.shape:
            a = self._alias[id(p)] = p.detach()
        return a

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """One Muon step of every param group (module docstring); returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            self._check_values(group, f"param_groups[{gi}]")
            momentum_opt, update_opt = self._inners(gi, group)
            live = [p for p in group["params"] if p.grad is not None]
            if not live:
                continue
            mu, nesterov = float(group["momentum"]), bool(group["nesterov"])
            inner = momentum_opt.param_groups[0]  # (a scheduler may move momentum)
            inner["momentum"] = inner["dampening"] = mu
            inner["lr"] = mu if nesterov else 1.0
            for j, p in enumerate(group["params"]):
                z = self._scratch[id(p)]
                g = p.grad
                if g is None:
                    z.grad = None
                    continue
                hand_over(self.state, momentum_opt.state, p, z, self._fresh_entry)
                if g.shape != p.shape:
                    raise ShapeMismatchError(f"param_groups[{gi}]['params'][{j}] has shape {tuple(p.shape)} but its "
                                             f"gradient {tuple(g.shape)}, expected the same")
                z.grad = g
                zl, gl = local(z), local(g) if is_dtensor(g) == is_dtensor(z) else None
                if gl is None or gl.shape != zl.shape:
                    zl.zero_()  # (the momentum step refuses the pair and says why)
                elif nesterov:
                    torch.mul(gl, mu - 1.0, out=zl)
                else:
                    zl.zero_()
            # B <- momentum * B + (1 - momentum) * g; Z <- Z - lr * B: -B (Z = 0, lr = 1) or, with Nesterov,
            # -((1 - momentum) * g + momentum * B) (Z = -(1 - momentum) * g, lr = momentum). Refused: nothing changed
            momentum_opt.step()
            for p in group["params"]:
                z = self._scratch[id(p)]
                z.grad = None
                if p.grad is not None:
                    self.state[p] = momentum_opt.state[z]
            lr = group["lr"]
            lr = float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)
            coefficients, steps, eps = tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"]
            for sub in update_opt.param_groups:
                sub["lr"] = lr * sub["ratio"]
                sub["weight_decay"] = float(group["weight_decay"]) / sub["ratio"]  # lr * wd / adjusted lr
            for p in live:
                z, alias = self._scratch[id(p)], self._alias_of(p)
                alias.grad = self._orthogonalised(z, p, coefficients, steps, eps)
            update_opt.step()  # p <- p * (1 - lr * wd) - adjusted_lr * O
            for p in live:
                self._alias[id(p)].grad = None
        return loss

    @staticmethod
    def _orthogonalised(z: torch.Tensor, p: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
        """NS of ``z`` (``-U``) in ``p``'s dtype; of a DTensor the whole matrix, gathered, this rank's shard kept."""
        if not is_dtensor(z):  # (in p's dtype and strides: a tall matrix's NS is a transpose)
            return torch.empty_like(p, memory_format=torch.preserve_format).copy_(
                zeropower_via_newtonschulz(z, coefficients, steps, eps))
        from torch.distributed.tensor import distribute_tensor

        whole = zeropower_via_newtonschulz(z.full_tensor(), coefficients, steps, eps).to(p.dtype).contiguous()
        # every rank holds the same result: each keeps its shard, no communication
        return distribute_tensor(whole, z.device_mesh, z.placements, src_data_rank=None)

    @staticmethod
    def _fresh_entry(p: torch.Tensor) -> Dict[str, Any]:
        """A zero buffer: torch's Muon starts its lerp from zeros (an SGD's first step would copy g)."""
        return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}

    # ------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.state = TrackedState(self.state)  # the next step's momentum step adopts the loaded entries
        self._inner.clear()

    def state_dict(self) -> Dict[str, Any]:
        out = super().state_dict()
        out["state"] = {k: dict(v) for k, v in out["state"].items()}
        return out

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state["state"] = {p: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in e.items()}
                          for p, e in self.state.items()}
        for k in ("_inner", "_scratch", "_alias"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._inner, self._scratch, self._alias = {}, {}, {}
        self.state = TrackedState(self.state)


__all__ = ["Muon", "zeropower_via_newtonschulz", "adjusted_ratio"]
