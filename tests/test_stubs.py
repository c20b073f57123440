"""The stubs in typings/ agree with the installed transformers (run on every tested release by `nox -s tests`).

mypy trusts these stubs blindly, so each declaration in them is compared with the real object:

- a re-export (`X as X`) or alias (`A = B`) is the very object the stub names;
- a class exists where the stub puts it and derives from each base the stub gives it;
- a method is of the stub's kind (plain, `@property`, `@classmethod`) and its parameters agree with
  `inspect.signature` of the real one (the rules are in `signature_mismatches`);
- an annotated attribute is present on a freshly built object, and its value has the stubbed type (the
  outer type only: `dict[int, bool]` checks `dict`).

mypy's stubtest compares more (annotations against runtime defaults, metaclasses, abstract methods), but it
wants a stub to describe whole modules; ours describe only what cachelife uses, and narrow some signatures on
purpose. Declarations the comparison cannot judge are listed in `NOT_SIGNATURES`, each with the behaviour
checked instead; an entry that stops differing fails, so the list stays short.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.cache_utils import (
    DynamicCache,
    EncoderDecoderCache,
    StaticCache,
    StaticLayer,
    StaticSlidingWindowLayer,
)
from transformers.generation.configuration_utils import CompileConfig, GenerationConfig
from transformers.generation.utils import GenerationMixin
from transformers.modeling_outputs import BaseModelOutput

from cachelife.tools import zoo

STUBS = Path(__file__).resolve().parents[1] / "typings" / "transformers"
Parameter = inspect.Parameter
POSITIONAL = (Parameter.POSITIONAL_ONLY, Parameter.POSITIONAL_OR_KEYWORD)
VARIADIC = (Parameter.VAR_POSITIONAL, Parameter.VAR_KEYWORD)


class _Unwritten:
    """The default of a stub parameter written `= ...`: present, value not stated."""

    def __repr__(self) -> str:
        return "..."


UNWRITTEN = _Unwritten()


def signature_mismatches(stub: inspect.Signature, real: inspect.Signature) -> list[str]:
    """How `stub` misdescribes `real`; empty when it agrees. A stub may say less than transformers, never else:

    1. the stub's positional parameters are transformers' first ones: same names, same kinds, same order;
    2. a keyword-only parameter of the stub is a keyword parameter of transformers (keyword-only, or also
       positional: the stub may ask callers to name it);
    3. a stub parameter has a default exactly when transformers' has one, equal to it unless written `...`;
    4. the stub's `*args` / `**kwargs` exist in transformers (their names do not matter to callers);
    5. every parameter the stub leaves out is optional in transformers (a default, or variadic), so that no
       call the stub allows lacks an argument.
    """
    found: list[str] = []
    real_params = real.parameters
    stub_positional = [p for p in stub.parameters.values() if p.kind in POSITIONAL]
    real_positional = [p for p in real_params.values() if p.kind in POSITIONAL]
    for index, param in enumerate(stub_positional):
        other = real_positional[index] if index < len(real_positional) else None
        if other is None or (other.name, other.kind) != (param.name, param.kind):
            there = "absent" if other is None else f"{other.name!r} ({other.kind.description})"
            found.append(f"positional parameter {index} is {param.name!r} in the stub, {there} in transformers")
    for param in stub.parameters.values():
        if param.kind is Parameter.KEYWORD_ONLY and (
            param.name not in real_params
            or real_params[param.name].kind not in (Parameter.KEYWORD_ONLY, Parameter.POSITIONAL_OR_KEYWORD)
        ):
            found.append(f"keyword-only {param.name!r} of the stub is no keyword parameter in transformers")
        if param.kind in VARIADIC and not any(other.kind is param.kind for other in real_params.values()):
            found.append(f"the stub takes {param}, transformers does not")
    for param in stub.parameters.values():
        other = real_params.get(param.name)
        if other is None or param.kind in VARIADIC:
            continue
        if (param.default is Parameter.empty) != (other.default is Parameter.empty):
            found.append(
                f"{param.name!r} has {shown(param.default)} in the stub, {shown(other.default)} in transformers"
            )
        elif param.default is not UNWRITTEN and param.default != other.default:
            found.append(f"{param.name!r} defaults to {param.default!r} in the stub, {other.default!r} in transformers")
    named = {param.name for param in stub.parameters.values() if param.kind not in VARIADIC}
    for other in real_params.values():
        if other.name not in named and other.kind not in VARIADIC and other.default is Parameter.empty:
            found.append(f"transformers requires {other.name!r}, which the stub leaves out")
    return found


def shown(default: object) -> str:
    return "no default" if default is Parameter.empty else f"default {default!r}"


# --- reading the stubs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stub:
    """One stub file: the transformers module it describes, its syntax tree and the names it can see."""

    module: str
    tree: ast.Module
    names: dict[str, Any]

    def resolve(self, node: ast.expr) -> Any:
        """The runtime object an expression of this stub names; generic arguments are dropped."""
        match node:
            case ast.Constant(value=None):
                return type(None)
            case ast.Name(id=name) if name in self.names:
                return self.names[name]
            case ast.Name(id=name):
                return getattr(builtins, name)
            case ast.Attribute(value=value, attr=attr):
                return getattr(self.resolve(value), attr)
            case ast.Subscript(value=value):
                return self.resolve(value)
            case ast.BinOp(left=left, op=ast.BitOr(), right=right):
                return self.resolve(left) | self.resolve(right)
        raise NotImplementedError(f"teach Stub.resolve to read {ast.unparse(node)!r} ({self.module})")

    def classes(self) -> Iterator[ast.ClassDef]:
        yield from (node for node in self.tree.body if isinstance(node, ast.ClassDef))

    def runtime(self, name: str) -> Any:
        return getattr(importlib.import_module(self.module), name)


def read_stub(path: Path) -> Stub:
    module = ".".join(("transformers", *path.relative_to(STUBS).with_suffix("").parts)).removesuffix(".__init__")
    tree = ast.parse(path.read_text())
    names: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name] = importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            source = importlib.import_module(node.module)
            for alias in node.names:
                names[alias.asname or alias.name] = getattr(source, alias.name)
        elif isinstance(node, ast.ClassDef):
            names[node.name] = getattr(importlib.import_module(module), node.name)
    return Stub(module, tree, names)


STUB_FILES = [read_stub(path) for path in sorted(STUBS.rglob("*.pyi"))]


def stub_signature(function: ast.FunctionDef) -> inspect.Signature:
    """The parameters a stub declares (names, kinds, defaults; annotations are mypy's business)."""
    args = function.args

    def default(node: ast.expr | None) -> Any:
        if node is None:
            return Parameter.empty
        if isinstance(node, ast.Constant) and node.value is Ellipsis:
            return UNWRITTEN
        return ast.literal_eval(node)

    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults += args.defaults
    params = [
        Parameter(
            arg.arg,
            Parameter.POSITIONAL_ONLY if index < len(args.posonlyargs) else Parameter.POSITIONAL_OR_KEYWORD,
            default=default(node),
        )
        for index, (arg, node) in enumerate(zip(positional, defaults, strict=True))
    ]
    if args.vararg is not None:
        params.append(Parameter(args.vararg.arg, Parameter.VAR_POSITIONAL))
    params += [
        Parameter(arg.arg, Parameter.KEYWORD_ONLY, default=default(node))
        for arg, node in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if args.kwarg is not None:
        params.append(Parameter(args.kwarg.arg, Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


@dataclass(frozen=True)
class Member:
    """A method or attribute a stub declares on a class."""

    stub: Stub
    cls: str
    node: ast.FunctionDef | ast.AnnAssign

    @property
    def name(self) -> str:
        return self.node.name if isinstance(self.node, ast.FunctionDef) else ast.unparse(self.node.target)

    @property
    def qualname(self) -> str:
        return f"{self.stub.module}.{self.cls}.{self.name}"


def members() -> list[Member]:
    return [
        Member(stub, cls.name, node)
        for stub in STUB_FILES
        for cls in stub.classes()
        for node in cls.body
        if isinstance(node, ast.FunctionDef | ast.AnnAssign)
    ]


METHODS = [member for member in members() if isinstance(member.node, ast.FunctionDef)]
ATTRIBUTES = [member for member in members() if isinstance(member.node, ast.AnnAssign)]


# --- declarations that are typing devices, not signatures ----------------------------------------------


def configs_take_any_keyword() -> None:
    for config_class in (transformers.PreTrainedConfig, transformers.T5Config, transformers.BartConfig,
                         transformers.WhisperConfig, transformers.LlamaConfig, transformers.Qwen2Config,
                         transformers.MistralConfig, transformers.Gemma2Config, transformers.GPT2Config,
                         transformers.OPTConfig):  # fmt: skip
        assert config_class(cachelife_probe=3).cachelife_probe == 3, config_class


def configs_hold_any_attribute() -> None:
    config = zoo.t5_tiny()
    config.cachelife_probe = 4
    assert config.cachelife_probe == 4
    assert config.hidden_size == config.d_model  # an alias through T5Config.attribute_map


def each_model_class_has_its_own_forward() -> None:
    for model_class in (transformers.T5ForConditionalGeneration, transformers.BartForConditionalGeneration,
                        transformers.WhisperForConditionalGeneration, transformers.LlamaForCausalLM):  # fmt: skip
        assert model_class.forward is not torch.nn.Module.forward, model_class


def each_model_class_generates() -> None:
    for model_class in (transformers.T5ForConditionalGeneration, transformers.BartForConditionalGeneration,
                        transformers.WhisperForConditionalGeneration, transformers.LlamaForCausalLM):  # fmt: skip
        assert issubclass(model_class, GenerationMixin), model_class


def beam_sampling_draws_in_top_k_continuations() -> None:
    """cachelife reads this method's source for whether the drawn candidates are sorted: it must be where
    beam sampling draws them."""
    source = inspect.getsource(GenerationMixin._get_top_k_continuations)
    assert "torch.multinomial" in source
    assert "do_sample" in inspect.signature(GenerationMixin._get_top_k_continuations).parameters


CONFIG_INIT = "configs take every field as a keyword and keep unknown ones; their signatures show no **kwargs"
# qualified name -> (why the signature comparison cannot judge it, the behaviour checked instead).
NOT_SIGNATURES: dict[str, tuple[str, Callable[[], None]]] = {
    "transformers.configuration_utils.PreTrainedConfig.__init__": (CONFIG_INIT, configs_take_any_keyword),
    **{
        f"transformers.models.{family}Config.__init__": (CONFIG_INIT, configs_take_any_keyword)
        for family in ("T5", "Bart", "Whisper", "Llama", "Marian", "Qwen2", "Mistral", "Gemma2", "GPT2", "OPT")
    },
    "transformers.configuration_utils.PreTrainedConfig.__getattr__": (
        "configs answer any attribute through __getattribute__ and attribute_map; the stub says so with __getattr__",
        configs_hold_any_attribute,
    ),
    "transformers.generation.utils.GenerationMixin._get_top_k_continuations": (
        "its arguments differ by version (5.17 takes vocab_size, 5.24 **kwargs); cachelife reads its source only",
        beam_sampling_draws_in_top_k_continuations,
    ),
    "transformers.modeling_utils.PreTrainedModel.forward": (
        "PreTrainedModel's own forward is torch's placeholder; every model class defines its own",
        each_model_class_has_its_own_forward,
    ),
}


# (class, base) -> why the stub gives the class a base it lacks, and the behaviour checked instead.
NOT_BASES: dict[tuple[str, str], tuple[str, Callable[[], None]]] = {
    ("transformers.modeling_utils.PreTrainedModel", "GenerationMixin"): (
        "each generating model class mixes GenerationMixin in itself; the stub gives `generate` to every model",
        each_model_class_generates,
    ),
}


# --- the checks ----------------------------------------------------------------------------------------


def decorators(function: ast.FunctionDef) -> set[str]:
    return {ast.unparse(node) for node in function.decorator_list}


def runtime_signature(member: Member) -> inspect.Signature:
    """The real member's signature, after checking it is of the stub's kind (property, classmethod, method)."""
    assert isinstance(member.node, ast.FunctionDef)
    owner = member.stub.runtime(member.cls)
    real = inspect.getattr_static(owner, member.name)
    kinds = decorators(member.node) & {"property", "classmethod", "staticmethod"}
    if kinds == {"property"}:
        assert isinstance(real, property), f"{member.qualname} is a property in the stub, {real!r} in transformers"
        assert real.fget is not None
        return inspect.signature(real.fget)
    if kinds == {"classmethod"}:
        assert isinstance(real, classmethod), f"{member.qualname} is a classmethod in the stub, {real!r} here"
        return inspect.signature(real.__func__)
    assert not kinds, f"teach runtime_signature the decorators {kinds} of {member.qualname}"
    assert inspect.isfunction(real), f"{member.qualname} is a method in the stub, {real!r} in transformers"
    return inspect.signature(real)


@pytest.mark.parametrize("member", METHODS, ids=lambda member: member.qualname.removeprefix("transformers."))
def test_stubbed_method_matches_transformers(member: Member) -> None:
    assert isinstance(member.node, ast.FunctionDef)
    if member.qualname in NOT_SIGNATURES:
        _, behaviour = NOT_SIGNATURES[member.qualname]
        behaviour()
        return
    assert signature_mismatches(stub_signature(member.node), runtime_signature(member)) == [], member.qualname


@pytest.mark.parametrize("qualname", sorted(NOT_SIGNATURES))
def test_each_listed_typing_device_still_differs_from_transformers(qualname: str) -> None:
    member = next(member for member in METHODS if member.qualname == qualname)
    assert isinstance(member.node, ast.FunctionDef)
    owner = member.stub.runtime(member.cls)
    real = inspect.getattr_static(owner, member.name, None)
    if real is not None and inspect.isfunction(real):
        differences = signature_mismatches(stub_signature(member.node), inspect.signature(real))
        assert differences, f"{qualname} now agrees with transformers: drop it from NOT_SIGNATURES"


def examples() -> dict[str, object]:
    """A freshly built object of each stubbed class that declares attributes."""
    config = zoo.t5_tiny()
    static = StaticCache(config=config, max_cache_len=4)
    return {
        "CacheLayerMixin": StaticLayer(max_cache_len=4),
        "StaticLayer": StaticLayer(max_cache_len=4),
        "StaticSlidingWindowLayer": StaticSlidingWindowLayer(max_cache_len=8, sliding_window=4),
        "DynamicCache": DynamicCache(),
        "StaticCache": static,
        "EncoderDecoderCache": EncoderDecoderCache(static, StaticCache(config=config, max_cache_len=3)),
        "PreTrainedConfig": config,
        "WhisperConfig": zoo.whisper_tiny(),
        "PreTrainedModel": transformers.T5ForConditionalGeneration(config),
        "CompileConfig": CompileConfig(),
        "GenerationConfig": GenerationConfig(),
        "BaseModelOutput": BaseModelOutput(last_hidden_state=torch.zeros(1)),
    }


@pytest.fixture(scope="module")
def built() -> dict[str, object]:
    return examples()


@pytest.mark.parametrize("member", ATTRIBUTES, ids=lambda member: member.qualname.removeprefix("transformers."))
def test_stubbed_attribute_is_there_with_its_type(member: Member, built: dict[str, object]) -> None:
    assert isinstance(member.node, ast.AnnAssign)
    assert member.cls in built, f"add a freshly built {member.cls} to examples() to check {member.name}"
    instance = built[member.cls]
    assert isinstance(instance, member.stub.runtime(member.cls))
    assert hasattr(instance, member.name), f"{member.qualname} is in the stub, not on a {type(instance).__name__}"
    expected = member.stub.resolve(member.node.annotation)
    if expected is not Any:
        value = getattr(instance, member.name)
        assert isinstance(value, expected), f"{member.qualname}: {value!r} is no {ast.unparse(member.node.annotation)}"


CLASSES = [(stub, cls) for stub in STUB_FILES for cls in stub.classes()]


@pytest.mark.parametrize(("stub", "cls"), CLASSES, ids=[f"{s.module}.{c.name}" for s, c in CLASSES])
def test_stubbed_class_has_the_stubbed_bases(stub: Stub, cls: ast.ClassDef) -> None:
    real = stub.runtime(cls.name)
    assert inspect.isclass(real), f"{stub.module}.{cls.name} is {real!r} in transformers"
    for base in cls.bases:
        if (f"{stub.module}.{cls.name}", ast.unparse(base)) in NOT_BASES:
            _, behaviour = NOT_BASES[f"{stub.module}.{cls.name}", ast.unparse(base)]
            assert not issubclass(real, stub.resolve(base)), "the base is real now: drop it from NOT_BASES"
            behaviour()
            continue
        assert issubclass(real, stub.resolve(base)), (
            f"{stub.module}.{cls.name} does not derive from {ast.unparse(base)}"
        )


def module_level_names() -> Iterator[tuple[Stub, str, ast.stmt]]:
    for stub in STUB_FILES:
        for node in stub.tree.body:
            if isinstance(node, ast.ImportFrom):
                yield from ((stub, alias.name, node) for alias in node.names if alias.asname == alias.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                yield stub, ast.unparse(target), node


NAMES = list(module_level_names())


@pytest.mark.parametrize(("stub", "name", "node"), NAMES, ids=[f"{s.module}.{n}" for s, n, _ in NAMES])
def test_stubbed_module_name_is_the_object_the_stub_says(stub: Stub, name: str, node: ast.stmt) -> None:
    real = stub.runtime(name)
    if isinstance(node, ast.ImportFrom):  # a re-export: the same object as in its home module
        assert node.module is not None
        assert real is getattr(importlib.import_module(node.module), name)
    elif isinstance(node, ast.Assign):  # an alias of another name
        assert real is stub.resolve(node.value)
    else:
        assert isinstance(node, ast.AnnAssign)
        assert isinstance(real, stub.resolve(node.annotation))


# --- the comparison can fail: each rule against a stub that breaks it ----------------------------------


def real_function(self: object, a: int, b: int = 1, *args: object, c: bool = False, **kwargs: object) -> None:
    """A stand-in for a transformers method."""


def stub_of(source: str) -> inspect.Signature:
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef)
    return stub_signature(node)


@pytest.mark.parametrize(
    ("stub", "complaint"),
    [
        ("def f(self, a, b=1, *args, c=False, **kwargs): ...", None),
        ("def f(self, a, b=..., *, c=..., **kwargs): ...", None),  # values unwritten, *args left out
        ("def f(self, a): ...", None),  # optional parameters left out
        ("def f(self, *, a, c=...): ...", None),  # a asked by name
        ("def f(self, x, b=1): ...", "positional parameter 1 is 'x'"),  # rule 1: renamed
        ("def f(self, b=1, a=2): ...", "positional parameter 1 is 'b'"),  # rule 1: reordered
        ("def f(self, a, b=1, d=2): ...", "positional parameter 3 is 'd'"),  # rule 1: invented
        ("def f(self, a, *, e=...): ...", "keyword-only 'e'"),  # rule 2
        ("def f(self, a, b): ...", "'b' has no default in the stub, default 1"),  # rule 3
        ("def f(self, a=0): ...", "'a' has default 0 in the stub"),  # rule 3
        ("def f(self, a, b=2): ...", "'b' defaults to 2 in the stub, 1 in transformers"),  # rule 3
        ("def f(self, a, *, c=True): ...", "'c' defaults to True in the stub, False"),  # rule 3
        ("def f(self, *args, **kwargs): ...", "transformers requires 'a'"),  # rule 5
        ("def f(self, **kwargs): ...", "transformers requires 'a'"),  # rule 5
    ],
)
def test_the_signature_comparison_finds_each_kind_of_mismatch(stub: str, complaint: str | None) -> None:
    found = signature_mismatches(stub_of(stub), inspect.signature(real_function))
    if complaint is None:
        assert found == []
    else:
        assert any(complaint in line for line in found), found


def test_the_comparison_refuses_variadics_that_transformers_lacks() -> None:
    def fixed(self: object, a: int) -> None:
        """No *args, no **kwargs."""

    found = signature_mismatches(stub_of("def f(self, a, *args, **kwargs): ..."), inspect.signature(fixed))
    assert found == ["the stub takes *args, transformers does not", "the stub takes **kwargs, transformers does not"]


def test_a_wrong_attribute_type_is_caught() -> None:
    stub = next(stub for stub in STUB_FILES if stub.module == "transformers.cache_utils")
    annotation = ast.parse("torch.Tensor | None", mode="eval").body
    assert not isinstance(3, stub.resolve(annotation))
    assert isinstance(None, stub.resolve(annotation))
    assert stub.resolve(ast.parse("dict[int, bool]", mode="eval").body) is dict


def test_the_stubs_are_all_read() -> None:
    files = {stub.module for stub in STUB_FILES}
    assert "transformers.cache_utils" in files
    assert "transformers" in files
    assert len(METHODS) > 30
    assert len(ATTRIBUTES) > 30


def test_the_documented_signature_of_prepare_cache_for_generation() -> None:
    parameters = list(inspect.signature(GenerationMixin._prepare_cache_for_generation).parameters)
    assert parameters == [
        "self",
        "generation_config",
        "model_kwargs",
        "generation_mode",
        "batch_size",
        "max_cache_length",
    ]
