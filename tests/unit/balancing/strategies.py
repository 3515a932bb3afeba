"""Hypothesis strategies for small balancing problems (n <= 9 layers, S <= 4 stages)."""

from __future__ import annotations

from hypothesis import strategies as st

from lightning_dynmo.balancing import LayerCost

# A few exact values (ties, zeros) mixed with arbitrary floats, so both edge cases and rounding show up.
times = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]), st.floats(0.0, 10.0, allow_nan=False))
layer = st.builds(
    LayerCost,
    fwd_time_s=times,
    bwd_time_s=times,
    num_params=st.integers(0, 50),
    memory_bytes=st.integers(0, 20),
)


@st.composite
def problems(draw: st.DrawFn, max_layers: int = 9, max_stages: int = 4) -> tuple[list[LayerCost], int]:
    costs = draw(st.lists(layer, min_size=1, max_size=max_layers))
    stages = draw(st.integers(1, min(max_stages, len(costs))))
    return costs, stages
