"""The paged cache's compaction after an eviction point, in its two forms: ``_compact_few`` (a
decoding step's few drops, from their lists: scatters of E entries and one shifting pass over the
order) against ``_compact`` (from the kept mask, by permutations) and against NumPy's meaning of
it: every head's kept tokens in logical slots 0 … n − 1 with their keys, values, positions and
state, the order listing them by position (then the empty slots ascending), the pages past
⌈n / P⌉ returned. Rounds of random drops (none, some, the newest, the oldest, a whole head) leave
the slots out of position order, as decoding does."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_priority import policy_of

from kvjax.cache.paged import PagedCache
from kvjax.slots import FEW_FIRST

L, B, Hk, K, P = 2, 2, 3, 4, 4


def _cache(rng, S, E, state_groups=1):
    count = rng.integers(E, S + 1, (L, B, Hk))
    pos = np.where(np.arange(S) < count[..., None], np.arange(S) * 2 + 1, -1).astype(np.int32)
    k = rng.standard_normal((L, B, Hk, S, K)).astype(np.float32)
    v = rng.standard_normal((L, B, Hk, S, K)).astype(np.float32)
    # zero at the empty slots, as the cache keeps it (a new token's state starts there)
    state = np.where(pos[:, :, :, None] >= 0, rng.random((L, B, Hk, state_groups, S)), 0.0)
    return PagedCache.from_dense(
        jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos), jnp.asarray(state, jnp.float32), P, (0, 0)
    )


def _drops(rng, cache, round_, E):
    """[L, B, Hk, C] a mask of at most E of each head's valid slots."""
    pos = np.asarray(cache.pos)
    drop = np.zeros(pos.shape, bool)
    for idx in np.ndindex(pos.shape[:3]):
        valid = np.flatnonzero(pos[idx] >= 0)
        by_pos = valid[np.argsort(pos[idx][valid])]
        n = min(rng.integers(0, E + 1), len(valid)) if round_ else E
        kind = rng.integers(4)
        if kind == 0:
            chosen = rng.choice(valid, n, replace=False)
        elif kind == 1:
            chosen = by_pos[len(by_pos) - n :]  # the newest
        elif kind == 2:
            chosen = by_pos[:n]  # the oldest
        else:
            chosen = valid[:0] if rng.random() < 0.5 else valid[: min(E, len(valid))]
        drop[idx + (chosen,)] = True
    return jnp.asarray(drop)


def _contents(cache):
    """Per head: {position: (key row, value row, state)} and the order's positions."""
    pos, order, state = (np.asarray(x) for x in (cache.pos, cache.order, cache.state))
    slots = jnp.broadcast_to(jnp.arange(cache.slots), pos.shape)
    k, v = (np.asarray(x) for x in cache._rows(jnp.minimum(slots, cache.slots - 1)))
    out = {}
    for idx in np.ndindex(pos.shape[:3]):
        n = int((pos[idx] >= 0).sum())
        assert (pos[idx][:n] >= 0).all(), "valid tokens not in slots 0 … n − 1"
        rows = {int(pos[idx][s]): (k[idx][s], v[idx][s], state[idx][:, s]) for s in range(n)}
        by_pos = pos[idx][order[idx][:n]]
        assert (np.diff(by_pos) > 0).all(), "the order does not list the slots by position"
        np.testing.assert_array_equal(order[idx][n:], np.arange(n, cache.slots))
        out[idx] = rows
    return out


@pytest.mark.parametrize(("S", "E"), [(24, 6), (8, 6)])
@pytest.mark.parametrize("scorer", ["h2o", "snapkv"])
def test_the_few_drops_compaction_equals_the_masks_and_numpys(scorer, S, E):
    """h2o: the state moves with its tokens; snapkv: it is reset at every eviction point. Up to E
    drops a head, E close to the capacity too (a short prompt compressed once)."""
    assert E <= FEW_FIRST
    p = policy_of(scorer)
    rng = np.random.default_rng(len(scorer) + S)
    cache = _cache(rng, S, E, state_groups=2)
    for round_ in range(6):
        drop = _drops(rng, cache, round_, E)
        valid = cache.pos >= 0
        keep = valid & ~drop
        gone, places = cache._listed(drop, E)
        few = cache._compact_few(p, gone, places, valid.sum(-1), cache.moments)
        masked = cache._compact(p, keep, gone, cache.moments, E)
        for name in ("pos", "order", "state", "n_pages", "free", "k_pages", "v_pages", "table"):
            np.testing.assert_array_equal(
                np.asarray(getattr(few, name)), np.asarray(getattr(masked, name)), err_msg=name
            )
        before, after = _contents(cache), _contents(few)
        pos = np.asarray(cache.pos)
        for idx, rows in before.items():
            kept = {int(x) for x in pos[idx][np.asarray(keep[idx])]}
            assert set(after[idx]) == kept
            for position in kept:
                for field, b, a in zip(("k", "v", "state"), rows[position], after[idx][position]):
                    if field != "state" or not p.scorer.reset_after_evict:
                        np.testing.assert_array_equal(a, b, err_msg=field)
            n_pages = -(-len(kept) // P)
            assert int(few.n_pages[idx]) == n_pages
        in_use = np.zeros(np.asarray(few.free).shape, bool)
        for idx in np.ndindex(pos.shape[:3]):
            in_use[idx[1], np.asarray(few.table[idx])[: int(few.n_pages[idx])]] = True
        np.testing.assert_array_equal(np.asarray(few.free), ~in_use)
        assert int(drop.sum()) > 0 or round_ > 0
        cache = few


def test_the_drop_lists_are_put_in_ascending_order():
    """``_ascending``: a head's drops (in the order the greedy steps took them, -1 past them)
    sorted, padded with C, by ranks compared pairwise."""
    rng = np.random.default_rng(0)
    cache = _cache(rng, 24, 6)
    C = cache.slots
    x = np.stack([rng.permutation(C)[:4] for _ in range(L * B * Hk)]).reshape(L, B, Hk, 4)
    x = np.where(rng.random(x.shape) < 0.3, -1, x)
    got = np.asarray(cache._ascending(jnp.asarray(x, jnp.int32), 6))
    np.testing.assert_array_equal(
        got, np.sort(np.pad(np.where(x >= 0, x, C), [(0, 0)] * 3 + [(0, 2)], constant_values=C), -1)
    )
