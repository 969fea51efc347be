"""Host syncs: the operations that stop the host until the GPU has drained its queue, counted on a
CPU, attributed to the minipar (or models/) file and line that asked for them.

A GPU step is fast only while the host runs ahead of the device, queueing kernels the device has
not reached yet. A few operations need a value the device has not produced, so the host stops and
waits for everything queued before them (and one inside a backward hook stalls the autograd thread
and the communication overlapped with it):

    read a device value         .item(), float()/int()/bool() of a tensor (an `if t:`), .tolist(),
                                .cpu(), .numpy(), .to("cpu")           aten._local_scalar_dense
    a result whose size is data  nonzero, masked_select, unique, boolean-mask indexing,
                                repeat_interleave without output_size, torch.equal
    a pageable host-to-device    torch.tensor(data, device=d), host.to(d) without non_blocking
    copy

On CUDA torch.cuda.set_sync_debug_mode("warn") names them (benchmarks/sync_check.py, in the device
check, uses it as the ground truth). A CPU has no device, so HostSyncs watches the same operations
through a TorchFunctionMode (the Python calls: .tolist, .cpu, .to, torch.tensor), a TorchDispatchMode
(every aten op, those of backward included) and, while it counts, those Python calls patched on
torch.Tensor and torch (autograd runs backward hooks without the function modes), and decides for
each tensor whether a GPU would hold it:

    device tensors   everything a step computes: by default any tensor (the parameters, their
                     gradients, the optimizer's moments, what the model and the collectives make),
                     the outputs of any op with a device input, and a factory's result when it
                     names a device (torch.zeros(..., device=self.device))
    host tensors     the `host` roots handed in (the data the batch source reads from, AdamW's step
                     counters, which torch keeps on the CPU), a factory's result without a device
                     (torch.tensor([...]), torch.from_numpy), ops whose inputs are all host, and a
                     non-blocking copy to "cpu" (into pinned memory on CUDA: no wait to start it)

so a data loader that builds and reads host tensors counts nothing, while the same .item() on a
loss counts one. A device name given as the string "cpu" means the host; a torch.device (the
trainer's) means the compute device, whatever its type here. What it cannot see: a sync inside
a C++ kernel other than those named above (none in minipar's step); and inside a backward hook a
factory's device argument (autograd runs hooks without the function modes), so a tensor a hook
makes from nothing counts as host until an op mixes it with a device tensor. A stop or a wait
that is not a read (work.wait(), an event) is not a sync here: on a GPU it waits for a stream or
an event, not for the queue.

    with HostSyncs(host=[tokens]) as syncs:
        ... steps ...
    syncs.counts()        Counter({"<file>:<line> tolist": 1, ...}), e.g. the train loop's read

It is a test's and a benchmark's instrument: a step runs a few times slower inside it.
"""
from __future__ import annotations

import collections
import os
import sys
from typing import Iterable, List, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_HOST = "_minipar_host"                 # set on a tensor a GPU run would keep on the host
_HERE = os.path.abspath(__file__)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
_ROOTS = tuple(os.path.join(_REPO, d) + os.sep for d in ("minipar", "models"))

_aten = torch.ops.aten
# a result whose size depends on the data: the host waits for the data to size it
_DATA_SIZED = {_aten.nonzero.default: "nonzero", _aten.masked_select.default: "masked_select",
               _aten._unique2.default: "unique", _aten.unique_consecutive.default: "unique",
               _aten.unique_dim.default: "unique", _aten.equal.default: "equal"}
_REPEAT = (_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor)
_INDEX = (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default)
_T = torch.Tensor
_READS = {_T.tolist: "tolist", _T.cpu: "cpu", _T.numpy: "numpy"}
_TO, _CUDA, _COPY, _TENSOR, _AS_TENSOR = _T.to, _T.cuda, _T.copy_, torch.tensor, torch.as_tensor
# what the function mode sees, patched in too while counting: autograd runs a backward hook (and its
# queued callbacks) without the torch-function modes, though with the dispatch modes
_PATCHED = [(torch.Tensor, name) for name in ("tolist", "cpu", "numpy", "to", "cuda", "copy_")] + \
    [(torch, "tensor"), (torch, "as_tensor")]


def is_host(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _HOST, False)


def _mark(out, host: bool) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            try:
                if host:
                    setattr(t, _HOST, True)
                elif getattr(t, _HOST, False):
                    delattr(t, _HOST)
            except (AttributeError, RuntimeError):     # (a tensor subclass without a __dict__)
                pass


def _any_device(args, kwargs) -> bool:
    return any(isinstance(t, torch.Tensor) and not is_host(t) for t in tree_flatten((args, kwargs))[0])


def _names_device(device) -> bool:
    """A device argument that means the compute device (a torch.device, "cuda", an index), not "cpu"."""
    return device is not None and not (isinstance(device, str) and device.split(":")[0] == "cpu")


def where() -> str:
    """The first frame of minipar/ or models/ on the stack (this module's own left out): 'path:line'."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and path.startswith(_ROOTS):
            return f"{os.path.relpath(path, _REPO)}:{frame.f_lineno}"
        frame = frame.f_back
    return "(outside-minipar)"


class _Functions(TorchFunctionMode):
    def __init__(self, owner: "HostSyncs"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        own = self.owner
        if getattr(func, "_host_syncs_patch", False):       # (torch hands the mode our patch too)
            return func(*args, **kwargs)
        if func in _READS and _any_device(args[:1], {}):
            own.record(_READS[func])
            out = func(*args, **kwargs)
            _mark(out, True)
            return out
        if func is _TO or func is _CUDA:
            return self._to(func, args, kwargs)
        if func is _COPY and len(args) >= 2:
            dst_host, src_host = is_host(args[0]), is_host(args[1])
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            if dst_host != src_host and not non_blocking:
                own.record("copy_ " + ("host->device" if src_host else "device->host"))
            out = func(*args, **kwargs)
            _mark(out, dst_host)
            return out
        out = func(*args, **kwargs)
        if func in (_TENSOR, _AS_TENSOR) and _names_device(kwargs.get("device")) \
                and not isinstance(args[0] if args else None, torch.Tensor):
            own.record("tensor(device=) host->device")      # built on the host, copied, waited for
            _mark(out, False)
        elif "device" in kwargs and kwargs["device"] is not None:
            _mark(out, not _names_device(kwargs["device"]))
        elif isinstance(out, torch.Tensor) or isinstance(out, (tuple, list)):
            _mark(out, not _any_device(args, kwargs))
        return out

    def _to(self, func, args, kwargs):
        own, src = self.owner, args[0]
        if func is _CUDA:
            device, non_blocking = torch.device("cuda"), kwargs.get("non_blocking", False)
            target = device
        else:
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, torch.Tensor):                # .to(other): other's placement
                target = "cpu" if is_host(target) else target.device
        out = func(*args, **kwargs)
        if device is None:                                      # a dtype change: the same side
            if out is not src:
                _mark(out, is_host(src))
            return out
        to_host = not _names_device(target if isinstance(target, str) else device if
                                    isinstance(target, (str, int)) else target)
        if is_host(src) == to_host:                             # no move (device to device: a no-op)
            return out
        if not non_blocking:
            own.record("to " + ("device->host" if to_host else "host->device"))
        if out is src:                                          # a CPU's .to() is the tensor itself:
            out = src.clone()                                   # the copy a GPU would make
        _mark(out, to_host)
        return out


class _Aten(TorchDispatchMode):
    def __init__(self, owner: "HostSyncs"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = _any_device(args, kwargs)
        if device:
            if func is _aten._local_scalar_dense.default:
                self.owner.record("item")
            elif func in _DATA_SIZED:
                self.owner.record(_DATA_SIZED[func])
            elif func in _REPEAT and kwargs.get("output_size") is None:
                self.owner.record("repeat_interleave")
            elif func in _INDEX and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                        and not is_host(i) for i in (args[1] if len(args) > 1 else ())):
                self.owner.record("boolean-mask index")
        out = func(*args, **kwargs)
        if func is not _aten._local_scalar_dense.default:
            _mark(out, not device)
        return out


class HostSyncs:
    """Counts the would-be host syncs of the code run inside it (the module docstring); `host`: the
    tensors (or lists, dicts, modules' tensors) that a GPU run keeps on the host."""

    def __init__(self, host: Iterable = ()):
        self.events: List[Tuple[str, str]] = []                # (file:line, what)
        self.step = None
        self.by_step: dict = collections.defaultdict(list)
        for t in tree_flatten(list(host))[0]:
            if isinstance(t, torch.Tensor):
                _mark(t, True)
        self._modes = (_Functions(self), _Aten(self))
        self._saved = []

    def record(self, what: str) -> None:
        event = (where(), what)
        self.events.append(event)
        self.by_step[self.step].append(event)

    def counts(self, step=...) -> collections.Counter:
        """{'file:line what': n} over everything, or over the events of one `step` (see at_step)."""
        events = self.events if step is ... else self.by_step.get(step, [])
        return collections.Counter(f"{w} {what}" for w, what in events)

    def at_step(self, step) -> None:
        """Attribute the events from now on to `step` (a test's label; None before the first)."""
        self.step = step

    def _patch(self) -> None:
        functions = self._modes[0]
        for owner, name in _PATCHED:
            original = getattr(owner, name)
            self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))

            def wrapper(*args, _original=original, **kwargs):
                if torch._C._is_torch_function_mode_enabled():     # the mode sees the call itself
                    return _original(*args, **kwargs)
                with torch._C.DisableTorchFunction():
                    return functions.__torch_function__(_original, (), args, kwargs)
            wrapper._host_syncs_patch = True
            setattr(owner, name, wrapper)

    def __enter__(self) -> "HostSyncs":
        for mode in self._modes:
            mode.__enter__()
        self._patch()
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, saved in reversed(self._saved):
            if saved is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)
        self._saved = []
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


_MISSING = object()


def host_tensors(*objects, depth: int = 3) -> list:
    """The tensors held by `objects` (their attributes, lists, tuples and dicts, `depth` levels down):
    what a data loader keeps between steps (its corpus, its cached epoch orders) is host data."""
    out, seen = [], set()

    def walk(x, d):
        if id(x) in seen or d < 0:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, d - 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, d - 1)
        elif hasattr(x, "__dict__") and not isinstance(x, (type, torch.nn.Module)):
            for v in vars(x).values():
                walk(v, d - 1)
    for o in objects:
        walk(o, depth)
    return out


def optimizer_host_state(optimizer: torch.optim.Optimizer) -> list:
    """AdamW's step counters, which torch keeps on the host unless the optimizer is fused or
    capturable (then they live with the parameters)."""
    out = []
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable"):
            continue
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                out.append(step)
    return out
