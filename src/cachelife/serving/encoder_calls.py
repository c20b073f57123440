"""Newcomers' encoders run together: the encoder calls of an engine's request threads, gathered into forwards.

Each request runs transformers' `generate` in a thread of the engine, and `generate` runs the model's encoder
on the request's input. While one encoder forward runs, the calls that arrive wait; the next forward takes the
waiting calls that fit together (at most `most`, oldest first) and hands each its own row of the output. A call
that finds no forward running starts one at once, so a lone request waits for nobody.

Calls fit together when they pass the same arguments with tensors of one row and equal shapes (Whisper's
features always do), or, for encoders whose every layer reads the attention mask and whose positions count from
the first token (`RIGHT_PADDED`), token prompts of other lengths: padded on the right under their masks, each
request's hidden states cut back to its own length. A call that passes positional arguments, more than one row,
values that cannot be compared, or asks for attentions or hidden states runs alone; so does each call of a group
whose forward failed, so that a failure is its own request's. Only the threads inside `gathering()` are gathered:
the model's other callers reach the encoder's own forward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final

import torch
from attrs import define, field
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

logger = logging.getLogger(__name__)

RIGHT_PADDED: Final = frozenset(
    {"t5", "mt5", "bart", "mbart", "plbart", "marian", "pegasus", "blenderbot", "blenderbot-small"}
)
"""Model types whose encoder output at a token does not change when the prompt is padded on the right under its
mask (checked for each by the engine's tests)."""

_PADDED_INPUTS: Final = ("input_ids", "attention_mask")


@define(eq=False, kw_only=True)
class _Call:
    kwargs: dict[str, Any]
    key: tuple[object, ...]
    length: int | None  # the prompt's own length, for calls padded on the right
    output: Any = field(default=None, init=False)  # what the encoder returned for this call (a ModelOutput)
    error: BaseException | None = field(default=None, init=False)

    @property
    def done(self) -> bool:
        return self.output is not None or self.error is not None


@define(eq=False, kw_only=True)
class EncoderCalls:
    """An encoder whose forward gathers the calls of the threads inside `gathering()` until `restore()`."""

    encoder: nn.Module
    forward: Callable[..., Any]  # the encoder's own
    most: int
    gathered: Callable[..., Any] | None  # what stands in the encoder's forward, until `restore()`
    pad: int  # the token id under the mask of a padded prompt
    padded: bool  # whether prompts of other lengths fit together (RIGHT_PADDED)
    calls: int = field(default=0, init=False)
    forwards: int = field(default=0, init=False)
    _waiting: list[_Call] = field(factory=list, init=False)
    _running: bool = field(default=False, init=False)
    _turn: threading.Condition = field(factory=threading.Condition, init=False)
    _inside: threading.local = field(factory=threading.local, init=False)

    @contextlib.contextmanager
    def gathering(self) -> Iterator[None]:
        """The encoder calls this thread makes inside are gathered with other threads' calls."""
        self._inside.on = True
        try:
            yield
        finally:
            self._inside.on = False

    def restore(self) -> None:
        """The encoder's own forward back in place (calls that are waiting are still served)."""
        if vars(self.encoder).get("forward") is self.gathered:
            del self.encoder.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = None if args or not getattr(self._inside, "on", False) else self._key(kwargs)
        if key is None:
            return self.forward(*args, **kwargs)
        call = _Call(kwargs=kwargs, key=key, length=int(kwargs["input_ids"].shape[1]) if self._pads(key) else None)
        with self._turn:
            self.calls += 1
            self._waiting.append(call)
        while True:
            with self._turn:
                while self._running and not call.done:
                    self._turn.wait()
                if call.done:
                    break
                self._running = True
                group = self._take()
            try:
                self._run(group)
            finally:
                with self._turn:
                    self._running = False
                    self._turn.notify_all()
        if call.error is not None:
            raise call.error
        return call.output

    def _key(self, kwargs: dict[str, Any]) -> tuple[object, ...] | None:
        """What calls that fit together share (None for a call that runs alone)."""
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states") or not kwargs.get("return_dict"):
            return None
        padded = self.padded and all(isinstance(kwargs.get(name), torch.Tensor) for name in _PADDED_INPUTS)
        key: list[object] = [padded]
        for name, value in sorted(kwargs.items()):
            if isinstance(value, torch.Tensor):
                if value.dim() == 0 or value.shape[0] != 1:
                    return None
                shape = value.shape[2:] if padded and name in _PADDED_INPUTS else value.shape
                key.append((name, value.dtype, value.device, tuple(shape)))
            elif value is None or isinstance(value, bool | int | float | str):
                key.append((name, value))
            else:
                return None
        return tuple(key)

    @staticmethod
    def _pads(key: tuple[object, ...]) -> bool:
        return key[0] is True

    def _take(self) -> list[_Call]:
        """The oldest waiting call and the waiting calls that fit with it, out of the waiting list."""
        key = self._waiting[0].key
        group = [call for call in self._waiting if call.key == key][: self.most]
        self._waiting = [call for call in self._waiting if call not in group]
        return group

    def _run(self, group: list[_Call]) -> None:
        """Every call of `group` done: together if they can be, else each alone with its own outcome."""
        try:
            if len(group) > 1:
                try:
                    self._run_together(group)
                    return
                except Exception:
                    logger.debug("cachelife.Engine: %d encoder calls failed together; each runs alone", len(group))
            for call in group:
                try:
                    call.output = self.forward(**call.kwargs)
                    self.forwards += 1
                except Exception as error:
                    call.error = error
        except BaseException as error:  # an interrupt: no call of the group is left waiting
            for call in group:
                if not call.done:
                    call.error = error
            raise

    def _run_together(self, group: list[_Call]) -> None:
        lengths = [call.length for call in group]
        longest = max((length for length in lengths if length is not None), default=0)
        kwargs: dict[str, Any] = {}
        for name, value in group[0].kwargs.items():
            if not isinstance(value, torch.Tensor):
                kwargs[name] = value
                continue
            parts = [call.kwargs[name] for call in group]
            if self._pads(group[0].key) and name in _PADDED_INPUTS:
                filler = self.pad if name == "input_ids" else 0
                parts = [nn.functional.pad(part, (0, longest - part.shape[1]), value=filler) for part in parts]
            kwargs[name] = torch.cat(parts)
        output = self.forward(**kwargs)
        hidden = output.get("last_hidden_state") if isinstance(output, ModelOutput) else None
        if not isinstance(hidden, torch.Tensor) or list(output.keys()) != ["last_hidden_state"]:
            msg = f"the encoder returned {type(output).__name__} with more than the last hidden state"
            raise TypeError(msg)
        self.forwards += 1
        for row, call in enumerate(group):
            own = hidden[row : row + 1] if call.length is None else hidden[row : row + 1, : call.length]
            call.output = type(output)(last_hidden_state=own.clone())


def gather_encoder_calls(model: PreTrainedModel, *, most: int) -> EncoderCalls | None:
    """Gather the calls of `model`'s encoder (see the module docstring); None for a model without an encoder
    the engine can gather for (none, or one that accelerate's hooks already wrap)."""
    get_encoder = getattr(model, "get_encoder", None)
    encoder = get_encoder() if callable(get_encoder) and model.config.is_encoder_decoder else None
    if not isinstance(encoder, nn.Module) or hasattr(encoder, "_hf_hook") or "forward" in vars(encoder):
        return None
    pad = getattr(model.config, "pad_token_id", None)
    calls = EncoderCalls(
        encoder=encoder, forward=encoder.forward, most=most, gathered=None, pad=pad if isinstance(pad, int) else 0,
        padded=model.config.model_type in RIGHT_PADDED,
    )  # fmt: skip

    @functools.wraps(encoder.forward)
    def gathered(*args: Any, **kwargs: Any) -> Any:
        return calls(*args, **kwargs)

    encoder.forward = calls.gathered = gathered
    return calls
