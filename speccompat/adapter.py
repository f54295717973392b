"""The adapter contract: what differs between vLLM releases, as overridable operations.

Each module under ``speccompat.adapters`` (the ``adapters/`` folder of the repository) serves a
contiguous range of vLLM releases. It subclasses the adapter of the previous range and overrides
only the operations that vLLM changed, recording each change as a :class:`Change`. Supporting a new
vLLM release therefore means one new module (plus one ``compat_matrix.yaml`` row), and reading the
modules in order reads the history of the internals speculators touches.

The operations are called from the patches in :mod:`speccompat.patches` (names speculators imported
from vLLM, replaced in speculators' own module namespace), from the fixed ``generate``
(:mod:`speccompat.generator`) and, inside vLLM's worker processes, from the capture
(:mod:`speccompat.capture`: what it reads of the model runner and the scheduler output). They never
change vLLM's own modules. Every vLLM symbol an operation reads is in the adapter's fingerprint, so
a vLLM that renamed one is refused when speculators imports it, naming the symbol.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from packaging.version import Version

from .probe import Symbol

__all__ = ["Adapter", "Change", "Done", "upstream_problem"]


#: ``upstream`` of records that share one: the speculators PR that listed the 0.11 -> 0.12 drift,
#: and the reasons there is no upstream fix to point at.
UPSTREAM_SP225 = "https://github.com/vllm-project/speculators/pull/225"
UPSTREAM_REPLACED = ("none: speculators 0.5 replaced this generator with vLLM's extract_hidden_states "
                     "(https://github.com/vllm-project/speculators/issues/335); 0.3/0.4 get no upstream fix")
UPSTREAM_CPU_ROTARY = "none: the CPU rotary op's strided multi-head query case is not reported upstream yet"
UPSTREAM_BLOCK_SIZE = "none: vLLM lets each platform pick the block size by design; speculators 0.3/0.4 hard-code 16"


def upstream_problem(upstream: str) -> str | None:
    """What is wrong with a record's ``upstream`` (``None``: a GitHub PR/issue URL or ``"none: why"``)."""
    if upstream.startswith("https://github.com/") and ("/pull/" in upstream or "/issues/" in upstream):
        return None
    if upstream.startswith("none: ") and len(upstream) > len("none: ") + 10:
        return None
    return f"upstream {upstream!r} is neither a GitHub PR/issue URL nor 'none: <why>'"


class Change(NamedTuple):
    """One vLLM change answered by an adapter: patch notes in the vllm-ascend style.

    ``vllm``: the release that introduced it. ``what``: the change in vLLM, with evidence
    (file:line of that release). ``breaks``: what it does to speculators 0.3/0.4 without
    speccompat. ``how``: what the adapter does about it. ``remove_when``: when the code can go.
    ``upstream``: the vLLM/speculators PR or issue URL, or ``"none: <why>"`` (required by the docs
    check, :func:`upstream_problem`).
    """

    vllm: str
    what: str
    breaks: str
    how: str
    remove_when: str
    upstream: str = ""

    def as_dict(self) -> dict[str, str]:
        return dict(self._asdict())


class Done:
    """The future of a step that already ran (what :meth:`Adapter.submit` returns for synchronous
    execution)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


class Adapter:
    """Base of every adapter. Subclasses set :attr:`since`, :attr:`changes`, :attr:`requires`."""

    #: First vLLM release served (inclusive). The next adapter's ``since`` is the exclusive end.
    since: ClassVar[str] = "0"
    #: Changes answered by this class itself (not its parents).
    changes: ClassVar[tuple[Change, ...]] = ()
    #: The fingerprint: every vLLM symbol the operations rely on, keyed by path. Subclasses merge
    #: their parent's with :func:`speccompat.probe.fingerprint`.
    requires: ClassVar[dict[str, Symbol]] = {}
    #: Decoder-layer classes whose output convention is known in this range: ``"module:Class"`` ->
    #: a key of :data:`speccompat.capture.CONVENTIONS` (``None``: no longer known). Subclasses merge
    #: their parent's: ``{**prev.Adapter.layer_outputs, ...}``.
    layer_outputs: ClassVar[dict[str, str | None]] = {}

    @classmethod
    def name(cls) -> str:
        return cls.__module__.rsplit(".", 1)[-1]

    @classmethod
    def since_version(cls) -> Version:
        return Version(cls.since)

    @classmethod
    def history(cls) -> list[Change]:
        """Every change answered by this adapter and its parents, oldest first."""
        out: list[Change] = []
        for klass in reversed(cls.__mro__):
            out.extend(vars(klass).get("changes", ()))
        return out

    def __repr__(self) -> str:
        return f"<adapter {self.name()} (vLLM >= {self.since})>"

    # ------------------------------------------------------------------------------ import time
    def moved_names(self) -> dict[tuple[str, str], str]:
        """``(module, name)`` that speculators imports -> module that holds the name in this vLLM."""
        return {}

    # ----------------------------------------------------------------------------- config time
    def vllm_config(self, cls: Any, **kw: Any) -> Any:
        return cls(**kw)

    def cache_config(self, cls: Any, **kw: Any) -> Any:
        raise NotImplementedError

    def scheduler_config(self, cls: Any, **kw: Any) -> Any:
        raise NotImplementedError

    def kv_cache_config_from_groups(self, fn: Any, **kw: Any) -> Any:
        raise NotImplementedError

    def scheduler(self, cls: Any, **kw: Any) -> Any:
        raise NotImplementedError

    def request(self, cls: Any, **kw: Any) -> Any:
        raise NotImplementedError

    # --------------------------------------------------------------------------- executor life
    def after_executor_start(self, executor: Any) -> None:
        """Engine-core steps due right after the executor's workers are up."""

    def after_kv_cache_init(self, executor: Any) -> None:
        """Engine-core steps due right after ``initialize_from_config``."""

    def submit(self, executor: Any, scheduler_output: Any) -> Any:
        """Start one scheduled step without waiting for it. Returns a future whose ``result()`` is
        the step's ``ModelRunnerOutput``; steps run, and their futures resolve, in submission order."""
        raise NotImplementedError

    def in_flight(self, executor: Any) -> int:
        """How many submitted steps the engine loop may leave uncollected (1: each step is collected
        before the next is scheduled; 2: the next step is scheduled and sent while one runs)."""
        raise NotImplementedError

    def unique_reply(self, reply: Any) -> Any:
        """Normalise the reply of ``collective_rpc(..., unique_reply_rank=0)`` to the bare value."""
        raise NotImplementedError

    # ------------------------------------------------------------------- worker side (capture)
    def decoder_layers(self, model: Any) -> tuple[Any, Any]:
        """``(base model, its decoder layers)`` of the loaded model, under any multimodal wrapper."""
        raise NotImplementedError

    def step_of(self, scheduler_output: Any) -> tuple[dict[str, int], int, dict[str, list[int]]]:
        """``(tokens scheduled per request, total, prompt token ids of the requests new in it)``."""
        raise NotImplementedError

    def is_warm_up(self, scheduler_output: Any, kwargs: dict[str, Any]) -> bool:
        """Whether a call of the runner's ``execute_model`` is profiling or warm-up, not a real step."""
        raise NotImplementedError

    def watch_batch(self, runner: Any, on_batch: Any) -> list[tuple[Any, str, Any]]:
        """Instance attributes to set on ``runner`` so that ``on_batch(batch)`` sees each step's
        batch where the runner builds one per step (``[]`` where :meth:`batch_order` reads it)."""
        raise NotImplementedError

    def batch_order(self, runner: Any, batch: Any) -> list[str | None]:
        """Request ids in the order the runner laid the step's tokens out (``batch``: what
        :meth:`watch_batch` recorded, or ``None``)."""
        raise NotImplementedError

    def step_positions(self, positions: Any) -> Any:
        """The 1-D token positions of a step from the ``positions`` the model was called with."""
        raise NotImplementedError

    def step_token_ids(self, runner: Any, batch: Any, num_tokens: int) -> Any:
        """The step's token ids from the runner's own buffers, for models called with
        ``inputs_embeds`` and ``input_ids=None`` (multimodal); ``None`` when they cannot be read."""
        raise NotImplementedError

    def layer_convention(self, layer_cls: type) -> str | None:
        """The output convention of decoder-layer class ``layer_cls`` (``None``: unknown, and the
        capture refuses the model). A subclass that inherits ``forward`` unchanged from a declared
        class follows its convention; one that overrides it must be declared itself."""
        forward = getattr(layer_cls, "forward", None)
        for klass in layer_cls.__mro__:
            path = f"{klass.__module__}:{klass.__qualname__}"
            if path in self.layer_outputs and getattr(klass, "forward", None) is forward:
                return self.layer_outputs[path]
        return None

    def gather_layer_output(self, stream: Any, num_tokens_padded: int, tp_size: int) -> Any:
        """A decoder layer's output for every token of the step (sequence-parallel shards gathered)."""
        raise NotImplementedError
