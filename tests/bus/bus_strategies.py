"""Hypothesis strategies for every schema type, derived from the structs' type hints."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from bus.schema import Sample

TEXT = st.text(max_size=8)
INTS = st.integers(-(2**63), 2**64 - 1)
FLOATS = st.floats()  # NaN and infinities included: they must survive the wire too

SMALL_ARRAYS = hnp.arrays(
    dtype=st.sampled_from([np.dtype(d) for d in ("bool", "int8", "uint16", "int32", "int64", "float16", "float64")]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
)

ANY = st.recursive(
    st.none() | st.booleans() | INTS | FLOATS | TEXT | st.binary(max_size=8) | SMALL_ARRAYS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)


def _tensor(dtypes: tuple[str, ...], length: int | None) -> st.SearchStrategy[np.ndarray]:
    size = st.integers(0, 6) if length is None else st.just(length)
    return st.sampled_from(dtypes).flatmap(lambda dtype: hnp.arrays(np.dtype(dtype), size))


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    """Samples honour their invariants: per-token arrays are exactly response_length long."""
    prompt_tokens, response_length = draw(st.integers(0, 6)), draw(st.integers(0, 6))
    optional = st.booleans()
    steps = (sorted(draw(st.lists(st.integers(0, response_length - 1), max_size=3)))
             if response_length and draw(optional) else None)
    return Sample(
        sample_id=draw(TEXT),
        group_id=draw(TEXT),
        index=draw(INTS),
        prompt=draw(TEXT | st.lists(st.dictionaries(TEXT, ANY, max_size=2), max_size=2)),
        prompt_tokens=prompt_tokens,
        tokens=draw(_tensor(("int32",), prompt_tokens + response_length)),
        response=draw(TEXT),
        response_length=response_length,
        label=draw(ANY),
        reward=draw(st.none() | FLOATS),
        loss_mask=draw(_tensor(("uint8", "bool", "float32"), response_length)) if draw(optional) else None,
        rollout_log_probs=draw(_tensor(("float32",), response_length)) if draw(optional) else None,
        token_versions=draw(_tensor(("int32",), response_length)) if draw(optional) else None,
        step_ends=None if steps is None else np.asarray(steps, dtype=np.int32),
        step_rewards=None if steps is None else np.asarray(
            draw(st.lists(st.floats(-2, 2, width=32), min_size=len(steps), max_size=len(steps))), dtype=np.float32),
        status=draw(st.sampled_from(["pending", "completed", "truncated", "aborted", "failed"])),
        metadata=draw(st.dictionaries(TEXT, ANY, max_size=3)),
        error=draw(st.none() | TEXT),
        images=draw(st.lists(st.binary(max_size=16), max_size=2)),
    )


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    """A strategy for any field type used in bus.schema, or for a whole struct."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *metadata = typing.get_args(tp)
        for meta in metadata:
            if isinstance(meta, msgspec.Meta) and meta.extra and "dtypes" in meta.extra:
                tensors = _tensor(meta.extra["dtypes"], None)
                return tensors if base is np.ndarray else st.none() | tensors
        return strategy_for(base)
    if tp is Sample:
        return samples()
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        hints = typing.get_type_hints(tp, include_extras=True)
        fields = {f.name: strategy_for(hints[f.name]) for f in msgspec.structs.fields(tp) if f.name != "v"}
        return st.builds(tp, **fields)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([strategy_for(arg) for arg in typing.get_args(tp)])
    if origin is Literal:
        return st.sampled_from(typing.get_args(tp))
    if origin is list:
        return st.lists(strategy_for(typing.get_args(tp)[0]), max_size=3)
    if origin is dict:
        key, value = typing.get_args(tp)
        return st.dictionaries(strategy_for(key), strategy_for(value), max_size=3)
    simple = {Any: ANY, str: TEXT, int: INTS, float: FLOATS, bool: st.booleans(), type(None): st.none(),
              bytes: st.binary(max_size=16)}
    if tp in simple:
        return simple[tp]
    raise TypeError(f"no strategy for {tp!r}; extend tests/bus/strategies.py")
