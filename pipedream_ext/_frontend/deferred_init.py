"""Deferred initialisation: meta-device layers -> real tensors, only for the layers kept.

A model built under ``with torch.device("meta"):`` has shapes but no storage. Each
rank materialises only the top-level layers (children of the ``nn.Sequential``) of
its own stages, so a rank's peak memory follows its stage, not the model.

**The seeding rule.** Layer ``l`` (its index among the model's children) is
initialised with the CPU generator (and, on CUDA, the pipeline device's generator)
seeded with ``layer_seed(seed, l) = seed * 2**16 + l``, inside
``torch.random.fork_rng``: layer ``l`` gets the same weights whichever stage, rank
or world size holds it, and the caller's global RNG state is left as it was.
Within a layer, every module that directly owns meta tensors calls its own
``reset_parameters()``, in ``named_modules()`` order; with ``init_fn`` given,
``init_fn(layer)`` is called once per layer instead. A tensor tied across layers
(a head sharing the embedding's weight) takes the values of its first layer: a
later layer's initialisation leaves it alone (and across ranks the pipeline copies
the first use's values, ``_shared.SharedGradients.synchronize_values``). :func:`materialize` applies
the same rule to a whole model in one process (a reference for tests and for
comparing with a pipeline). Generators differ per device type, so a CUDA
pipeline's weights equal ``materialize(model, "cuda")``'s, not the CPU's.

**What must be initialised.** Every materialised tensor starts filled with a
sentinel (NaN, or the byte ``0xA5`` for integer and bool dtypes). After
``reset_parameters()`` a tensor still holding the sentinel was not reset (e.g. a
causal mask registered in ``__init__``: its values cannot be recovered from the
meta device) and is an error naming it. With ``init_fn``, non-persistent buffers
must be set (no state dict brings them); parameters and persistent buffers it
leaves alone keep the sentinel until ``pipe.load_state_dict`` overwrites them.
Initialisation may fill a tensor in place or assign a new one of the meta tensor's
shape and dtype (``layer.freqs_cis = precompute()``, torchtitan's idiom, or
``register_buffer`` again): the new tensor is kept, moved to the stage's device.

Pure apart from allocating on the device: tested in one process.

Index legend: ``l`` layer (child of the ``nn.Sequential``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

__all__ = ["DEFAULT_INIT_SEED", "InitFn", "Memo", "layer_seed", "has_meta_tensors", "check_seed",
           "check_initialisable", "materialize_layer", "materialize", "init_units",
           "check_traced_initialisable", "materialize_traced", "replace_materialized",
           "unset_tensors"]

#: The base seed of deferred initialisation when none is given.
DEFAULT_INIT_SEED = 0
#: ``init_fn(layer)``: initialises every parameter and buffer of one top-level layer in place.
InitFn = Callable[[nn.Module], None]
#: Shared tensors: the meta tensor's id -> (the meta tensor, its replacement). The meta
#: tensor is kept so that its id cannot be reused by another tensor meanwhile.
Memo = Dict[int, Tuple[torch.Tensor, torch.Tensor]]

# The CPU generator (mt19937) uses the low 32 bits of a seed only: 16 bits each for
# the base seed and the layer keep every (seed, layer) pair's stream distinct.
_SEED_LIMIT = 1 << 16
_SENTINEL_BYTE = 0xA5


def layer_seed(seed: int, layer: int) -> int:
    """The RNG seed of top-level layer ``layer``: ``seed * 2**16 + layer``.

    Distinct for every (seed, layer) pair with ``0 <= seed, layer < 2**16`` and
    below 2**32 (the bits the CPU generator uses), so two base seeds never share
    a layer's weights.

    Args:
        seed: the base seed (``PipeDream(..., init_seed=)``), in ``[0, 2**16)``.
        layer: the layer's index among the model's children.

    Returns:
        The value given to ``manual_seed`` before initialising that layer.

    Raises:
        ValueError: a model of more than 2**16 top-level layers.
    """
    if not 0 <= layer < _SEED_LIMIT:
        raise ValueError(f"layer index {layer} is outside [0, 2**16), which deferred "
                         "initialisation seeds; group layers into fewer top-level children")
    return seed * _SEED_LIMIT + layer


def check_seed(seed: object) -> int:
    """Checks a base seed.

    Args:
        seed: the value given as ``init_seed``.

    Returns:
        The seed as an ``int``.

    Raises:
        ValueError: not an integer in ``[0, 2**16)``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"init_seed={seed!r} is not an integer in [0, 2**16); pass e.g. "
                         f"init_seed={DEFAULT_INIT_SEED}")
    return seed


def _direct_tensors(module: nn.Module) -> Iterator[Tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, is_parameter)`` of what ``module`` owns itself (not its children)."""
    for name, p in module._parameters.items():  # noqa: SLF001 - direct ownership only
        if p is not None:
            yield name, p, True
    for name, b in module._buffers.items():  # noqa: SLF001
        if b is not None:
            yield name, b, False


def _meta_names(module: nn.Module) -> List[str]:
    return [name for name, t, _ in _direct_tensors(module) if t.is_meta]


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` (recursively) is on the meta device."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def _qualified(prefix: str, name: str) -> str:
    return ".".join(part for part in (prefix, name) if part)


def check_initialisable(model: nn.Sequential, init_fn: Optional[InitFn]) -> None:
    """Checks, before anything is allocated, that every meta layer can be initialised.

    Every module that directly owns meta parameters or buffers needs its own
    ``reset_parameters()`` unless ``init_fn`` is given. Runs over the whole model
    (meta tensors cost nothing), so every rank raises the same error.

    Args:
        model: the whole model.
        init_fn: the user's per-layer initialiser, or ``None``.

    Raises:
        ValueError: names each such module by its qualified name in ``model``,
            its class and its meta tensors, and says to pass ``init_fn`` or give
            the class a ``reset_parameters()``.
    """
    if init_fn is not None:
        if not callable(init_fn):
            raise ValueError(f"init_fn={init_fn!r} is not callable; pass a function "
                             "init_fn(layer) that initialises one top-level layer in place")
        return
    bad = []
    for qualname, module in model.named_modules():
        names = _meta_names(module)
        if names and not callable(getattr(module, "reset_parameters", None)):
            bad.append(f"'{qualname}' ({type(module).__name__}: {', '.join(names)})")
    if bad:
        raise ValueError(
            f"module{'s' if len(bad) > 1 else ''} {', '.join(bad)} "
            f"{'have' if len(bad) > 1 else 'has'} parameters or buffers on the meta device but no "
            "reset_parameters() to initialise them; pass PipeDream(..., init_fn=fn), where "
            "fn(layer) initialises one top-level layer in place, or give the module a "
            "reset_parameters()")


def _sentinel_fill(t: torch.Tensor) -> bool:
    """Fills ``t`` with the sentinel; returns whether :func:`_is_sentinel` can detect it."""
    if t.numel() == 0:
        return False
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
        return True
    if not t.is_contiguous():
        return False
    t.reshape(-1).view(torch.uint8).fill_(_SENTINEL_BYTE)
    return True


def _is_sentinel(t: torch.Tensor) -> bool:
    """Whether ``t`` still holds only the sentinel, in chunks: a set tensor is told
    by its first chunk, and no temporary as large as the tensor is made."""
    floating = t.is_floating_point() or t.is_complex()
    flat = t.reshape(-1) if floating else t.reshape(-1).view(torch.uint8)
    for chunk in flat.split(1 << 16):
        if not bool(torch.isnan(chunk).all() if floating else (chunk == _SENTINEL_BYTE).all()):
            return False
    return True


def unset_tensors(module: nn.Module) -> List[str]:
    """The parameters and buffers of ``module`` still holding only the sentinel every
    tensor materialised from the meta device starts as (a DTensor: this rank's shard):
    what ``init_fn`` left to a state dict that never came.

    Args:
        module: a rank's stages (a model built on the meta device).

    Returns:
        Their names in ``module``, parameters first.
    """
    found = []
    with torch.no_grad():
        for name, t in (*module.named_parameters(), *module.named_buffers()):
            local = t.to_local() if callable(getattr(t, "to_local", None)) else t
            detectable = local.is_floating_point() or local.is_complex() or local.is_contiguous()
            if not local.is_meta and local.numel() > 0 and detectable and _is_sentinel(local.detach()):
                found.append(name)
    return found


@dataclasses.dataclass
class _Slot:
    """A meta tensor of a layer given storage: where it sits and what it became.

    Attributes:
        qualname: its qualified name in the layer.
        module: the module owning it directly, under ``name``.
        meta: the meta tensor (its shape and dtype).
        tensor: the tensor now there (the new storage, or what initialisation put there).
        is_param: a parameter (else a buffer).
        persistent: in the state dict (parameters and persistent buffers).
        detectable: the sentinel it was filled with can be told (:func:`_is_sentinel`).
        reused: an earlier layer materialised it (a tie across layers).
    """

    qualname: str
    module: nn.Module
    name: str
    meta: torch.Tensor
    tensor: torch.Tensor
    is_param: bool
    persistent: bool
    detectable: bool
    reused: bool

    def current(self) -> Optional[torch.Tensor]:
        """What the module holds under ``name`` now (initialisation may assign anew)."""
        owned = self.module._parameters if self.is_param else self.module._buffers  # noqa: SLF001
        return owned.get(self.name)

    def install(self, value: torch.Tensor) -> None:
        owned = self.module._parameters if self.is_param else self.module._buffers  # noqa: SLF001
        owned[self.name] = value
        self.tensor = value


def _to_empty(layer: nn.Module, device: torch.device, memo: Memo,
              recurse: bool = True) -> List[_Slot]:
    """Replaces every meta tensor of ``layer`` with uninitialised storage on ``device``.

    Unlike ``Module.to_empty`` only meta tensors are replaced, and a tensor shared
    by several modules (tied weights) stays shared (through ``memo``). Without
    ``recurse``, only the tensors ``layer`` owns directly.

    Returns:
        One slot per meta tensor replaced (``reused``: an earlier layer's tensor).
    """
    slots: List[_Slot] = []
    earlier = set(memo)  # meta tensors an earlier layer materialised
    fresh: Set[int] = set()  # new tensors whose sentinel can be told
    for qualname, module in (layer.named_modules() if recurse else [("", layer)]):
        non_persistent = module._non_persistent_buffers_set  # noqa: SLF001
        for name, t, is_param in list(_direct_tensors(module)):
            if not t.is_meta:
                continue
            if id(t) not in memo:
                # Not empty_like: on a meta tensor it imports sympy (~36 MiB of RSS).
                data = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
                memo[id(t)] = (t, nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data)
                with torch.no_grad():
                    if _sentinel_fill(data):
                        fresh.add(id(memo[id(t)][1]))
            new = memo[id(t)][1]
            slots.append(_Slot(_qualified(qualname, name), module, name, t, new, is_param,
                               is_param or name not in non_persistent, id(new) in fresh,
                               id(t) in earlier))
            fresh.discard(id(new))  # a tie inside the layer: checked under its first name
            if is_param:
                module._parameters[name] = new  # noqa: SLF001
            else:
                module._buffers[name] = new  # noqa: SLF001
    return slots


def _adopt_assignments(slots: Sequence[_Slot], device: torch.device, memo: Memo,
                       where: str, layer: str) -> None:
    """Keeps the tensors initialisation assigned anew instead of filling in place
    (``layer.freqs_cis = precompute()``, torchtitan's idiom, or ``register_buffer``
    again), moved to ``device``; every other holder of the same tensor (a tie) gets
    it too. A tensor tied to an earlier layer keeps that layer's (the first use
    initialises it).

    Args:
        where: what initialised the layer (``init_fn``), for messages.
        layer: the layer's child name (tensors are named ``layer.qualname``).

    Raises:
        ValueError: an assignment of another shape or dtype than the meta tensor's,
            or a tensor removed (``None``), naming it.
    """
    replaced: Dict[int, torch.Tensor] = {}
    for slot in slots:
        value = slot.current()
        if value is slot.tensor or slot.reused:
            continue
        kind = "parameter" if slot.is_param else "buffer"
        if value is None:
            raise ValueError(f"{where} removed the {kind} '{_qualified(layer, slot.qualname)}' "
                             "(set it to None); set it to a tensor, or fill it in place")
        if value.shape != slot.meta.shape or value.dtype != slot.meta.dtype:
            raise ValueError(
                f"{where} assigned the {kind} '{_qualified(layer, slot.qualname)}' a tensor of "
                f"{_describe(value)}, but the model built on the meta device has "
                f"{_describe(slot.meta)}; assign one of that shape and dtype (or fill it in "
                f"place: .copy_(...))")
        if value.is_meta:
            raise ValueError(f"{where} assigned the {kind} '{_qualified(layer, slot.qualname)}' "
                             "a tensor on the meta device, which has no values; build it on the "
                             "device of the tensor it replaces")
        if value.device != device:
            moved = value.detach().to(device)
            value = nn.Parameter(moved, requires_grad=value.requires_grad) if slot.is_param else moved
        replaced[id(slot.tensor)] = value
    for slot in slots:
        if slot.reused and slot.current() is not slot.tensor:
            slot.install(slot.tensor)
        elif id(slot.tensor) in replaced:
            memo[id(slot.meta)] = (slot.meta, replaced[id(slot.tensor)])
            slot.install(replaced[id(slot.tensor)])
            slot.detectable = False  # assigned: set by definition


def _describe(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)} and dtype {t.dtype}"


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The CPU generator (and ``device``'s, if CUDA) seeded with ``seed``; restored after."""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        for index in devices:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def materialize_layer(layer: nn.Module, index: int, name: str, device: Union[str, torch.device],
                      seed: int = DEFAULT_INIT_SEED, init_fn: Optional[InitFn] = None,
                      memo: Optional[Memo] = None, *, direct: bool = False,
                      init: Optional[InitFn] = None, init_name: str = "reset_parameters()") -> None:
    """Gives one top-level layer's meta tensors real values on ``device``, in place.

    Args:
        layer: the layer (a child of the model); tensors not on meta stay as they are.
        index: the layer's index among the model's children (its seed: :func:`layer_seed`).
        name: the layer's child name, for messages.
        device: where the new tensors live.
        seed: the base seed.
        init_fn: called as ``init_fn(layer)`` instead of the modules' ``reset_parameters()``.
        memo: replacements so far, shared across layers to keep ties.
        direct: only the tensors ``layer`` owns itself (a traced model's unit:
            :func:`materialize_traced`); its ``index`` is then its unit index.
        init: called as ``init(module)`` for every module owning meta tensors instead of
            ``module.reset_parameters()`` (a Hugging Face model's ``_init_weights``).
        init_name: how messages name ``init``.

    Raises:
        ValueError: a tensor that ``reset_parameters()`` did not set (or, with
            ``init_fn``, a non-persistent buffer it did not set), or one it assigned
            anew with another shape or dtype, named by its qualified name in the model.
    """
    device = torch.device(device)
    owners = [module for _, module in (layer.named_modules() if not direct else [("", layer)])
              if _meta_names(module)]
    if not owners:
        return
    memo = {} if memo is None else memo
    slots = _to_empty(layer, device, memo, recurse=not direct)
    # A tensor tied to an earlier layer keeps that layer's values (the first use
    # initialises it, as `head.weight = emb.weight` after building keeps emb's).
    kept = [(s.tensor, s.tensor.detach().clone()) for s in
            {id(s.tensor): s for s in slots if s.reused}.values()]
    where = "init_fn" if init_fn is not None else init_name
    label = f"module '{name}' (unit {index})" if direct else f"layer {index} ('{name}')"
    with _seeded(layer_seed(seed, index), device), torch.no_grad():
        if init_fn is not None:
            init_fn(layer)
        else:
            for module in owners:
                if init is not None:
                    init(module)
                else:
                    module.reset_parameters()
        try:
            _adopt_assignments(slots, device, memo, where, name)
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None
        for t, value in kept:
            t.copy_(value)
    unset = [s.qualname for s in slots if s.detectable and not s.reused and
             (init_fn is None or not s.persistent) and _is_sentinel(s.tensor)]
    if unset:
        names = ", ".join(f"'{_qualified(name, q)}'" for q in unset)
        if init_fn is None:
            raise ValueError(
                f"{label}: {names} on the meta device were not set by {init_name} (values "
                "computed in __init__, such as a registered mask, cannot be recovered from the "
                "meta device); pass PipeDream(..., init_fn=fn) that sets them, or build those "
                f"tensors in {init_name}")
        raise ValueError(
            f"{label}: init_fn left the non-persistent buffer(s) {names} "
            "unset, and no state dict can bring them; set them in init_fn (fill them in "
            "place, .copy_(...), or assign a tensor of the same shape and dtype)")


def materialize(model: nn.Module, device: Union[str, torch.device] = "cpu",
                seed: int = DEFAULT_INIT_SEED, init_fn: Optional[InitFn] = None,
                layers: Optional[Sequence[int]] = None) -> nn.Module:
    """Materialises a meta-built model in place with the pipeline's seeding rule.

    The whole model (or the given layers) gets exactly the weights a pipeline
    built with ``PipeDream(model, ..., init_seed=seed, init_fn=init_fn)`` gives
    its layers on any partition: use it for an unsplit reference. An
    ``nn.Sequential`` follows the per-layer rule (also when cut by ``split_points``);
    any other model the per-unit rule of :func:`materialize_traced`.

    Args:
        model: the model; only meta tensors are replaced.
        device: where the new tensors live.
        seed: the base seed (see :func:`layer_seed`).
        init_fn: ``init_fn(layer)`` per layer (traced: per unit) instead of
            ``reset_parameters()`` (traced: the model's ``_init_weights`` if it has one).
        layers: indices of the children to materialise (default: all; ``nn.Sequential`` only).

    Returns:
        ``model``.

    Raises:
        ValueError: a bad seed, a module that cannot be initialised (see
            :func:`check_initialisable`), or a tensor left unset.
    """
    seed = check_seed(seed)
    if not isinstance(model, nn.Sequential):
        check_traced_initialisable(model, init_fn)
        materialize_traced(model, device, seed, init_fn)
        return model
    assert isinstance(model, nn.Sequential)
    check_initialisable(model, init_fn)
    children = list(model.named_children())
    memo: Memo = {}
    for l in (range(len(children)) if layers is None else layers):
        name, layer = children[l]
        materialize_layer(layer, l, name, device, seed, init_fn, memo)
    return model


# -- traced models: one unit per module owning meta tensors ------------------------------------
def init_units(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The *units* of a traced meta model: every module owning meta tensors directly,
    in ``named_modules()`` order; unit ``u`` is seeded with ``layer_seed(seed, u)``."""
    return [(name, module) for name, module in model.named_modules() if _meta_names(module)]


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s shape and dtype (a parameter if ``t`` is one)."""
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta


#: A tensor slot: ``(owning module, its _parameters or _buffers, name, tensor)``.
_Held = Tuple[nn.Module, Dict[str, Optional[torch.Tensor]], str, torch.Tensor]


def _slots(module: nn.Module, recurse: bool, meta: bool) -> List[_Held]:
    """The slots of ``module`` (and below, with ``recurse``) holding meta tensors, or
    (``meta=False``) tensors with values."""
    return [(m, owned, name, t) for m in (module.modules() if recurse else [module])
            for owned in (m._parameters, m._buffers)  # noqa: SLF001 - direct ownership
            for name, t in owned.items() if t is not None and t.is_meta == meta]


def _init_restricted(unit: nn.Module, calls: Sequence[Tuple[nn.Module, InitFn]],
                     real: Sequence[_Held]) -> None:
    """Calls ``init(module)`` for each ``(module, init)`` of ``calls`` in order, with the
    tensors of ``real`` that ``unit`` does not own swapped for meta stand-ins meanwhile
    (meta ops draw no random numbers and change nothing)."""
    others = [slot for slot in real if slot[0] is not unit]
    for module, init in calls:
        try:
            for _, owned, name, t in others:
                owned[name] = _stand_in(t)
            init(module)
        finally:
            for _, owned, name, t in others:
                owned[name] = t


@contextlib.contextmanager
def _one_unit_at_a_time(model: nn.Module, on: bool) -> Iterator[Tuple[List[_Held], List[_Held]]]:
    """Keeps every tensor of ``model`` that a unit materialises on meta again once its unit
    is done, until the end: then each unit's initialisation (its ancestors' included)
    sees only its own tensors with values, without a walk over the model per unit.

    Transformers' ``initialize_weights`` calls ``_init_weights`` on every module, children
    before parents, and a parent may set its children's tensors (GPT-2's attention scales
    ``c_proj.weight``): called for the modules holding a unit, it must set only that
    unit's tensors, so that each gets the same values whichever units a rank holds.

    Yields:
        ``(real, done)``: the slots holding values before (never swapped for good; the
        caller swaps them around each call, :func:`_init_restricted`), and a list to which
        the caller appends each materialised unit's slots after putting their meta
        tensors back; at the end every one gets its new tensor again.
    """
    real = _slots(model, True, False) if on else []
    done: List[_Held] = []
    try:
        yield real, done
    finally:
        for _, owned, name, t in done:
            owned[name] = t


def _is_submodel(module: nn.Module) -> bool:
    """A Hugging Face ``PreTrainedModel`` (its own ``_init_weights``, as transformers'
    ``smart_apply`` dispatches it to the modules below it)."""
    return callable(getattr(module, "_init_weights", None)) and \
        callable(getattr(module, "_initialize_weights", None))


def _unit_inits(model: nn.Module, units: Sequence[Tuple[str, nn.Module]], root: InitFn
                ) -> List[Tuple[InitFn, List[Tuple[nn.Module, InitFn]]]]:
    """Per unit: its initialiser and the ``(ancestor, initialiser)`` pairs above it,
    nearest first (transformers' order: children before parents). Each module's
    initialiser is the ``_init_weights`` of the nearest sub-model holding it, else
    ``root`` (the model's)."""
    modules = dict(model.named_modules())
    inits: Dict[str, InitFn] = {"": root}
    found: List[Tuple[InitFn, List[Tuple[nn.Module, InitFn]]]] = []
    for name, _ in units:
        chain: List[Tuple[nn.Module, InitFn]] = [(model, root)]
        parts = name.split(".") if name else []
        for k in range(1, len(parts) + 1):
            prefix, sub = ".".join(parts[:k]), modules[".".join(parts[:k])]
            if prefix not in inits:
                inits[prefix] = sub._init_weights if _is_submodel(sub) else inits[".".join(parts[:k - 1])]  # noqa: SLF001
            chain.append((sub, inits[prefix]))
        found.append((chain[-1][1], chain[-2::-1]))
    return found


def _unit_init(model: nn.Module) -> Tuple[Optional[InitFn], str]:
    """The model's own per-module initialiser (a Hugging Face ``PreTrainedModel``'s
    ``_init_weights``), else ``None`` (each module's ``reset_parameters()``)."""
    hf = getattr(model, "_init_weights", None)
    if callable(hf):
        return hf, f"{type(model).__name__}._init_weights"
    return None, "reset_parameters()"


def check_traced_initialisable(model: nn.Module, init_fn: Optional[InitFn]) -> None:
    """Checks, before anything is allocated, that every unit of a traced meta model has an
    initialiser: ``init_fn``, the model's ``_init_weights`` or the unit's ``reset_parameters()``.

    Raises:
        ValueError: names every unit without one, its class and meta tensors.
    """
    if isinstance(model, nn.Sequential):  # its per-layer rule (materialize_traced)
        check_initialisable(model, init_fn)
        return
    if init_fn is not None or _unit_init(model)[0] is not None:
        check_initialisable(nn.Sequential(), init_fn)  # init_fn callable
        return
    bad = [f"'{name}' ({type(m).__name__}: {', '.join(_meta_names(m))})"
           for name, m in init_units(model) if not callable(getattr(m, "reset_parameters", None))]
    if bad:
        raise ValueError(
            f"module{'s' if len(bad) > 1 else ''} {', '.join(bad)} of {type(model).__name__} "
            f"{'have' if len(bad) > 1 else 'has'} parameters or buffers on the meta device but no "
            "reset_parameters() to initialise them (and the model has no _init_weights, as a "
            "Hugging Face model has); pass PipeDream(..., init_fn=fn), where fn(module) "
            "initialises one module's own tensors in place, or give the module a "
            "reset_parameters()")


def materialize_traced(model: nn.Module, device: Union[str, torch.device],
                       seed: int = DEFAULT_INIT_SEED, init_fn: Optional[InitFn] = None,
                       tensors: Optional[Sequence[torch.Tensor]] = None,
                       memo: Optional[Memo] = None) -> Memo:
    """Gives a traced model's meta tensors real values with the traced seeding rule.

    An ``nn.Sequential`` (given ``split_points``) keeps the per-layer rule of
    :func:`materialize`: its units are its children. Any other model: unit ``u``
    (:func:`init_units`) is initialised alone, under the RNG seeded with
    ``layer_seed(seed, u)``, by ``init_fn(unit)``, else the model's
    ``_init_weights(unit)``, else ``unit.reset_parameters()``: each tensor gets the same
    values whichever units are materialised with it. With ``_init_weights``, every
    module holding the unit follows, nearest first, as transformers' ``initialize_weights``
    calls it on the whole model (children before parents; a sub-model's own
    ``_init_weights`` below it), each seeing only the unit's tensors with values: a parent
    that sets its children's tensors (GPT-2 scales ``c_proj`` by ``1/sqrt(2 n_layer)``)
    does so here too. A tensor owned by several units (tied) takes the first unit's values.

    Args:
        model: the whole model (only its meta tensors are replaced).
        device: where the new tensors live.
        seed: the base seed.
        init_fn: ``init_fn(module)`` per unit instead of the model's own initialiser.
        tensors: the meta tensors wanted (a rank's stages); default: all.
        memo: replacements so far (extended and returned).

    Returns:
        Every replacement: the meta tensor's id -> (meta tensor, new tensor).

    Raises:
        ValueError: a tensor the initialiser left unset (named), or see
            :func:`materialize_layer`.
    """
    memo = {} if memo is None else memo
    # An nn.Sequential keeps its per-layer rule (the same weights as cut by balance=).
    layers = isinstance(model, nn.Sequential)
    units = list(model.named_children()) if layers else init_units(model)
    init, init_name = (None, "reset_parameters()") if layers else _unit_init(model)

    def owned(module: nn.Module) -> List[torch.Tensor]:
        if layers:
            return [t for t in (*module.parameters(), *module.buffers()) if t.is_meta]
        return [t for _, t, _ in _direct_tensors(module) if t.is_meta]

    wanted = None if tensors is None else {id(t) for t in tensors if t.is_meta}
    first: Dict[int, int] = {}
    for u, (_, module) in enumerate(units):
        for t in owned(module):
            first.setdefault(id(t), u)
    needed: Set[int] = set()
    for u, (_, module) in enumerate(units):
        ids = [id(t) for t in owned(module)]
        if wanted is None or any(i in wanted for i in ids):
            needed.add(u)
            needed.update(first[i] for i in ids)  # a tie: its first owner sets it
    # A model's _init_weights: also every module holding the unit, as on the whole model.
    chains = _unit_inits(model, units, init) if init is not None and init_fn is None else None
    with _one_unit_at_a_time(model, chains is not None) as (real, done):
        for u in sorted(needed):
            name, module = units[u]
            unit_init = init
            if chains is not None:
                own, ancestors = chains[u]
                unit_init = functools.partial(_init_restricted, calls=[(module, own), *ancestors],
                                              real=real)
                metas = _slots(module, False, True)
            materialize_layer(module, u, name, device, seed, init_fn, memo, direct=not layers,
                              init=unit_init, init_name=init_name)
            if chains is not None:  # back on meta until every unit is done
                for m, owned, key, meta in metas:
                    done.append((m, owned, key, owned[key]))
                    owned[key] = meta
    return memo


def replace_materialized(modules: Sequence[nn.Module], memo: Memo, what: str) -> None:
    """Puts the materialised tensors of ``memo`` wherever ``modules`` (a rank's stages,
    which hold the model's tensors, sometimes in containers of their own) hold the
    meta ones.

    Raises:
        ValueError: a meta tensor no unit owns (a tensor computed while tracing on the
            meta device), named: it has no values and nothing can give it any.
    """
    for root in modules:
        for qualname, module in root.named_modules():
            for name, t, is_param in list(_direct_tensors(module)):
                if not t.is_meta:
                    continue
                if id(t) not in memo:
                    raise ValueError(
                        f"{what}: '{_qualified(qualname, name)}' is on the meta device but is no "
                        "parameter or buffer of the model (a tensor computed while tracing), so "
                        "nothing can give it values; build the model on a real device, or "
                        "compute that tensor in forward")
                owned = module._parameters if is_param else module._buffers  # noqa: SLF001
                owned[name] = memo[id(t)][1]
