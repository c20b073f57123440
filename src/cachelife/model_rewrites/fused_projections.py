"""Fused projections: the linear projections of one layer that read the same input (self-attention's query, key
and value; a gated MLP's gate and up projections) computed as one matrix product, reversibly.

`fuse_projections(model)` concatenates each group's weights (and biases) once into one tensor, a non-persistent
buffer of the module that holds the group, and gives the group's parameters that tensor's storage: they become
views of it, the same `Parameter` objects with the same values, dtypes, devices and `requires_grad`, so the state
dict and in-place loads (`load_state_dict`, `copy_`) see and reach the fused tensors. Each member's forward then
takes its slice of one product: the first member called with an input computes the product of the fused weight,
the others, called with that same tensor, take their slices of it. `FusedProjections.restore()` gives every
parameter a storage of its own again and removes the buffers and the forwards: the model is as it was, its state
dict equal bit for bit.

Results never depend on who calls in which order: a member called with another tensor, twice with one tensor, or
with gradients enabled (the fused tensors carry none), computes its own product from its own parameters.
Cross-attention modules (`CROSS_ATTENTION`) are left alone: their key and value read the encoder output, their
query the decoder's states, so one product would compute what nobody reads.

Memory, for a group of projections with o_i outputs each, k inputs, and element sizes s_w (weight) and s_b (bias):
- fused: the weights take sum(o_i) * k * s_w bytes, as before (one tensor instead of several). Where some but not
  all members of a group have a bias, those without get zeros in the fused bias, sum(o_i over them) * s_b bytes
  more (`FusedProjections.extra_bytes`; Whisper's bias-free key projection: d_model * s_b per self-attention).
  Nothing else is added.
- while fusing or restoring: one group at a time is held twice, sum(o_i) * (k * s_w + s_b) bytes at the peak. A
  parameter whose old storage is referenced elsewhere (a view of a larger tensor, a reference kept by the caller)
  keeps that storage alive as well.

A conversion of the model (`model.to`, `.cuda()`, `.half()`: `nn.Module._apply`) converts each group's
parameters and fuses them again at once, the group's parent module at a time: the fused buffers are not
converted as copies of their own, so moving a fused model to a GPU holds no second copy of its projections there.
A parameter given another storage otherwise (`load_state_dict(assign=True)`, a deep copy of the model) is
noticed at its group's next eager call, which fuses the group again from the parameters as they are then; a
compiled forward traced after a parameter was replaced computes that group's products separately.
`save_pretrained` of a fused model writes the parameters as the unfused model's (the buffers are not persistent).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Final

import torch
from attrs import define, field, frozen
from torch import nn

from cachelife.core.tracing import tracing_here

logger = logging.getLogger(__name__)

GROUPS: Final[tuple[tuple[str, ...], ...]] = (
    ("q_proj", "k_proj", "v_proj"),  # self-attention: the Llama family, BART, Whisper, Marian, OPT
    ("q", "k", "v"),  # T5's self-attention
    ("gate_proj", "up_proj"),  # the Llama family's gated MLP
    ("wi_0", "wi_1"),  # T5's gated MLP (gated-gelu, gated-silu)
)
"""Names of child projections of one module that read the module's input, fused in this order."""

CROSS_ATTENTION: Final = frozenset({"encoder_attn", "EncDecAttention", "crossattention"})
"""Names under which encoder-decoder models hold cross-attention modules, whose projections are not fused."""

# (the input, the fused product of it, a bit per member that has taken its slice)
_Pending = tuple[torch.Tensor, torch.Tensor, int]
Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""A linear product's function: (input, weight, bias) -> output, as `torch.nn.functional.linear`."""


@define(eq=False, kw_only=True)
class ProjectionGroup:
    """The projections of one module fused into one product: the module (`parent`, at `path`), the members'
    names and modules, and the names of the buffers that hold the fused weight and bias."""

    path: str
    parent: nn.Module
    names: tuple[str, ...]
    members: tuple[nn.Linear, ...]
    # The parameters as fused, compared by identity: another object means the member was given new ones.
    _parameters: tuple[tuple[torch.Tensor, torch.Tensor | None], ...] = field(alias="parameters")
    _pending: _Pending | None = field(default=None, alias="pending")
    # How the group multiplies its input by a weight and bias; another rewrite may fold a norm into it
    # (`cachelife.model_rewrites.fused_layers`), and sets it back before this group is restored.
    product: Product = field(default=nn.functional.linear)

    @property
    def weight_name(self) -> str:
        return buffer_names(self.names)[0]

    @property
    def bias_name(self) -> str:
        return buffer_names(self.names)[1]

    @property
    def outputs(self) -> int:
        """Rows of the fused weight: the members' outputs together."""
        return sum(member.out_features for member in self.members)

    @property
    def starts(self) -> tuple[int, ...]:
        """Each member's first row in the fused weight."""
        sizes = [member.out_features for member in self.members]
        return tuple(sum(sizes[:index]) for index in range(len(sizes)))

    @property
    def extra_bytes(self) -> int:
        """Bytes of the zeros the fused bias holds for members without a bias of their own."""
        bias = self._buffer(self.bias_name)
        if bias is None:
            return 0
        missing = sum(member.out_features for member in self.members if member.bias is None)
        return missing * bias.element_size()

    def share(self) -> None:
        """Concatenate the members' current parameters into the fused buffers and make the parameters views of
        them (the first fusion, and a group whose parameters were given other storage since)."""
        weights = [member.weight for member in self.members]
        with torch.no_grad():
            weight = torch.cat([tensor.detach() for tensor in weights])
            bias = None
            if any(member.bias is not None for member in self.members):
                bias = torch.cat([_bias_or_zeros(member) for member in self.members])
            self.parent.register_buffer(self.weight_name, weight, persistent=False)
            if bias is not None:
                self.parent.register_buffer(self.bias_name, bias, persistent=False)
            elif self.bias_name in self.parent._buffers:
                delattr(self.parent, self.bias_name)
            for member, start in zip(self.members, self.starts, strict=True):
                member.weight.data = weight[start : start + member.out_features]
                if member.bias is not None and bias is not None:
                    member.bias.data = bias[start : start + member.out_features]
        self._parameters = tuple((member.weight, member.bias) for member in self.members)
        self._pending = None

    def install(self) -> None:
        for index, member in enumerate(self.members):
            member.__dict__["forward"] = MemberForward(self, index)
        conversion = self.parent.__dict__.get("_apply")
        if not isinstance(conversion, FusedConversion):
            conversion = self.parent.__dict__["_apply"] = FusedConversion(self.parent)
        conversion.groups.append(self)

    def restore(self) -> None:
        """Give each parameter lying in the fused buffers a storage of its own, then remove the buffers and the
        members' forwards."""
        fused = (self._buffer(self.weight_name), self._buffer(self.bias_name))
        storages = {tensor.untyped_storage().data_ptr() for tensor in fused if tensor is not None}
        with torch.no_grad():
            for member in self.members:
                for parameter in (member.weight, member.bias):
                    if parameter is not None and parameter.untyped_storage().data_ptr() in storages:
                        parameter.data = parameter.data.clone()
        for name in (self.weight_name, self.bias_name):
            if name in self.parent._buffers:
                delattr(self.parent, name)
        for member in self.members:
            forward = member.__dict__.get("forward")
            if isinstance(forward, MemberForward) and forward.group is self:
                del member.__dict__["forward"]
        conversion = self.parent.__dict__.get("_apply")
        if isinstance(conversion, FusedConversion) and self in conversion.groups:
            conversion.groups.remove(self)
            if not conversion.groups:
                del self.parent.__dict__["_apply"]
        self._pending = None

    def take_buffers(self) -> dict[str, torch.Tensor]:
        """Remove the fused buffers from the parent and return them (name -> tensor)."""
        taken = {}
        for name in (self.weight_name, self.bias_name):
            found = self.parent._buffers.get(name)
            if isinstance(found, torch.Tensor):
                del self.parent._buffers[name]
                taken[name] = found
        return taken

    def after_conversion(self, taken: dict[str, torch.Tensor]) -> None:
        """After the parent's conversion ran without the fused buffers (`taken`): where the parameters still lie
        in them (a conversion that changed nothing), put them back; else fuse the converted parameters again,
        or leave the group unfused (each member its own product) where they can no longer be fused."""
        self.parent._buffers.update(taken)
        if self._shares_storage():
            return
        for name in taken:
            del self.parent._buffers[name]
        if parameters_unfusable(self.names, self.members) is None:
            self.share()

    def output(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Member `index`'s projection of `hidden`: its slice of the group's product of `hidden`."""
        member = self.members[index]
        if torch.is_grad_enabled():
            return self.product(hidden, member.weight, member.bias)
        bit = 1 << index
        pending = self._pending
        if pending is not None and pending[0] is hidden and not pending[2] & bit:
            product, taken = pending[1], pending[2] | bit
        elif (weight := self._current_weight()) is not None:
            product, taken = self.product(hidden, weight, self._buffer(self.bias_name)), bit
        else:
            return self.product(hidden, member.weight, member.bias)
        self._pending = None if taken == (1 << len(self.members)) - 1 else (hidden, product, taken)
        return product.narrow(-1, self.starts[index], member.out_features)

    def _current_weight(self) -> torch.Tensor | None:
        """The fused weight if it holds the members' parameters, else None. Eagerly, a group whose parameters
        were given other storage is fused again here; while dynamo traces, only replaced parameter objects are
        seen."""
        replaced = any(
            member.weight is not weight or member.bias is not bias
            for member, (weight, bias) in zip(self.members, self._parameters, strict=True)
        )
        if tracing_here():
            return None if replaced else self._buffer(self.weight_name)
        if not replaced and self._shares_storage():
            return self._buffer(self.weight_name)
        if parameters_unfusable(self.names, self.members) is not None:
            return None
        logger.debug("%s: the parameters of %s were given other storage; fusing them again", self.path, self.names)
        self.share()
        return self._buffer(self.weight_name)

    def _shares_storage(self) -> bool:
        weight, bias = self._buffer(self.weight_name), self._buffer(self.bias_name)
        for member, start in zip(self.members, self.starts, strict=True):
            if weight is None or not _lies_at(member.weight, weight, start, member.out_features):
                return False
            if member.bias is not None and not (
                bias is not None and _lies_at(member.bias, bias, start, member.out_features)
            ):
                return False
        return True

    def _buffer(self, name: str) -> torch.Tensor | None:
        found = self.parent._buffers.get(name)
        return found if isinstance(found, torch.Tensor) else None


@frozen
class MemberForward:
    """The forward of one fused member (`nn.Linear.forward`'s signature): its slice of its group's product."""

    group: ProjectionGroup
    index: int

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.index, input)


@define(eq=False)
class FusedConversion:
    """The `_apply` of a module holding fused groups (`nn.Module.to` and every other conversion call it): the
    module's own conversion, run without the fused buffers, then each group fused again from its converted
    parameters (see the module docstring)."""

    parent: nn.Module
    groups: list[ProjectionGroup] = field(factory=list)

    def __call__(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        taken = [group.take_buffers() for group in self.groups]
        try:
            type(self.parent)._apply(self.parent, fn, recurse)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        finally:
            for group, buffers in zip(self.groups, taken, strict=True):
                group.after_conversion(buffers)
        return self.parent


@define(eq=False)
class FusedProjections:
    """What `fuse_projections` did to a model: the groups it fused, and why it left the others (path and member
    names -> reason). `restore()` undoes it; a second call does nothing."""

    groups: tuple[ProjectionGroup, ...]
    skipped: Mapping[str, str]
    _restored: bool = field(default=False, alias="restored")

    @property
    def restored(self) -> bool:
        return self._restored

    @property
    def extra_bytes(self) -> int:
        """Bytes the fused model holds beyond the unfused one's (see the module docstring)."""
        return 0 if self._restored else sum(group.extra_bytes for group in self.groups)

    def restore(self) -> None:
        if self._restored:
            return
        for group in self.groups:
            group.restore()
        self._restored = True
        logger.debug("restored %d group(s) of fused projections", len(self.groups))


def fuse_projections(model: nn.Module) -> FusedProjections:
    """Fuse every group of projections of `model` that `GROUPS` names and that can be fused (see the module
    docstring); returns what restores them. Groups that cannot be are left as they are, with the reason in
    `skipped`: cross-attention, members that are not plain `torch.nn.Linear` modules (subclasses, hooks, a
    replaced forward, one already fused), or parameters that differ in dtype, device, input size or layout."""
    chosen: list[ProjectionGroup] = []
    skipped: dict[str, str] = {}
    for path, parent, names, members in _candidates(model):
        reason = unfusable(path, parent, names, members)
        if reason is None:
            chosen.append(
                ProjectionGroup(
                    path=path,
                    parent=parent,
                    names=names,
                    members=members,
                    parameters=tuple((m.weight, m.bias) for m in members),
                )
            )
        else:
            skipped[f"{path}.{{{','.join(names)}}}"] = reason
    done: list[ProjectionGroup] = []
    try:
        for group in chosen:
            done.append(group)  # before it changes anything: restoring undoes a half-fused group too
            group.share()
            group.install()
            logger.debug("%s: fused %s into one product of %d outputs", group.path, group.names, group.outputs)
    except BaseException:
        for group in done:
            group.restore()
        raise
    for name, reason in skipped.items():
        logger.debug("%s: not fused: %s", name, reason)
    return FusedProjections(tuple(done), skipped)


def buffer_names(names: tuple[str, ...]) -> tuple[str, str]:
    """The names of the buffers holding the fused weight and bias of the projections `names`."""
    joined = "_".join(names)
    return f"cachelife_fused_{joined}_weight", f"cachelife_fused_{joined}_bias"


def unfusable(path: str, parent: nn.Module, names: tuple[str, ...], members: tuple[nn.Linear, ...]) -> str | None:
    """Why the projections `names` of the module `parent` (at `path`) cannot be fused, or None if they can."""
    if path.rsplit(".", maxsplit=1)[-1] in CROSS_ATTENTION:
        return "cross-attention: its key and value read the encoder output"
    for name, member in zip(names, members, strict=True):
        if type(member) is not nn.Linear:
            return f"{name} is a {type(member).__name__}, not a torch.nn.Linear"
        if isinstance(member.__dict__.get("forward"), MemberForward):
            return "already fused"
        if "forward" in member.__dict__ or member._forward_hooks or member._forward_pre_hooks:
            return f"{name} has a forward of its own or forward hooks"
    return _parent_unfusable(parent, names) or parameters_unfusable(names, members)


def _parent_unfusable(parent: nn.Module, names: tuple[str, ...]) -> str | None:
    """Why `parent` cannot hold the fused group of `names`, or None if it can."""
    taken = [name for name in buffer_names(names) if hasattr(parent, name)]
    if taken:
        return f"the module has an attribute {taken[0]!r} already"
    conversion = parent.__dict__.get("_apply")
    if conversion is not None and not isinstance(conversion, FusedConversion):
        return "the module has a conversion (_apply) of its own"
    return None


def parameters_unfusable(names: tuple[str, ...], members: tuple[nn.Linear, ...]) -> str | None:
    """Why the parameters of `members` cannot be concatenated into one weight and bias, or None if they can."""
    first = members[0].weight
    if len({id(member.weight) for member in members}) < len(members):
        return "members share a weight"
    for name, member in zip(names, members, strict=True):
        if member.in_features != members[0].in_features:
            return f"input sizes differ: {name} takes {member.in_features}, {names[0]} {members[0].in_features}"
        for tensor in (member.weight, member.bias):
            if tensor is None:
                continue
            if type(tensor.data) is not torch.Tensor or tensor.is_meta or not tensor.is_contiguous():
                return f"{name} holds a {type(tensor.data).__name__} that is on the meta device or not contiguous"
            if (tensor.dtype, tensor.device) != (first.dtype, first.device):
                return f"{name} is {tensor.dtype} on {tensor.device}, {names[0]} {first.dtype} on {first.device}"
    return None


def _candidates(model: nn.Module) -> Iterator[tuple[str, nn.Module, tuple[str, ...], tuple[nn.Linear, ...]]]:
    for path, module in model.named_modules():
        children = dict(module.named_children())
        for names in GROUPS:
            found = tuple(children.get(name) for name in names)
            if all(isinstance(child, nn.Linear) for child in found):
                yield path, module, names, tuple(child for child in found if isinstance(child, nn.Linear))


def _bias_or_zeros(member: nn.Linear) -> torch.Tensor:
    if member.bias is not None:
        return member.bias.detach()
    return torch.zeros(member.out_features, dtype=member.weight.dtype, device=member.weight.device)


def _lies_at(tensor: torch.Tensor, fused: torch.Tensor, row: int, rows: int) -> bool:
    """Whether `tensor` is the view of `rows` rows of `fused` from row `row` on, as fusion made it."""
    return (
        tensor.dtype == fused.dtype
        and tensor.device == fused.device
        and tensor.shape == (rows, *fused.shape[1:])
        and tensor.data_ptr() == fused.data_ptr() + row * fused.stride(0) * fused.element_size()
    )
