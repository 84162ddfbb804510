"""The store of compressed contexts (kvjax.serving.contexts): one compression per document and
options, answers equal to a freshly compressed context's, persistence across a restart, the memory
limit, deletion and the errors."""

import json
import logging
import os
import shutil

import numpy as np
import pytest

import kvjax
from kvjax.eviction import RepeatPrompt
from kvjax.serving.contexts import ContextStore

SNAPKV = dict(budget=16, scorer="snapkv", obs_window=8)
KVZIP = dict(
    budget=16,
    scorer="kvzip",
    repeat_prompt=RepeatPrompt(first=(5, 6, 7), later=(5, 6, 8), colon=(9,)),
)
QUESTION = np.arange(10, 16, dtype=np.int32)
BIG = 1 << 40  # memory_bytes that holds every context


def document(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 97, 40).astype(np.int32)


def answer(params, context) -> np.ndarray:
    return np.asarray(kvjax.decode(params, context, QUESTION, 8, evict=False, stop_ids=()))


def assert_answers_like_fresh(params, context, tokens, eviction):
    fresh = kvjax.prefill(params, tokens, **eviction)
    np.testing.assert_array_equal(np.asarray(context.logits), np.asarray(fresh.logits))
    np.testing.assert_array_equal(answer(params, context), answer(params, fresh))


def stored(root) -> list[str]:
    return sorted(name for name in os.listdir(root) if os.path.isdir(os.path.join(root, name)))


def test_adding_a_document_twice_compresses_it_once(tiny_llama, tmp_path):
    store = ContextStore(tiny_llama, str(tmp_path), BIG)
    first, created = store.add(document(0), **SNAPKV)
    again, created_again = store.add(document(0), **SNAPKV)
    assert created and not created_again
    assert again == first and stored(tmp_path) == [first.id]
    assert store.records() == [first]
    assert first.n_tokens == 40 and first.eviction == SNAPKV
    context = store.get(first.id)
    assert first.kept == int((np.asarray(context.cache.pos) >= 0).sum())
    assert 0 < first.kept < 40 * tiny_llama.config.n_layers * tiny_llama.config.n_kv_heads
    other, created_other = store.add(document(0), **(SNAPKV | dict(budget=14)))
    assert created_other and other.id != first.id and other.kept < first.kept
    spelled, created_spelled = store.add(document(0), **SNAPKV, n_sink=4, window=8, impl=None)
    assert not created_spelled and spelled == first  # the defaults, spelled out: the same settings


def test_a_kvzip_context_from_the_store_answers_like_a_fresh_one(tiny_llama, tmp_path):
    store = ContextStore(tiny_llama, str(tmp_path), BIG)
    record, _ = store.add(document(1), **KVZIP)
    assert record.eviction["repeat_prompt"]["first"] == [5, 6, 7]
    assert_answers_like_fresh(tiny_llama, store.get(record.id), document(1), KVZIP)


def test_a_restarted_store_lists_and_serves_the_saved_contexts(tiny_llama, tmp_path, caplog):
    store = ContextStore(tiny_llama, str(tmp_path), BIG)
    record, _ = store.add(document(2), **SNAPKV)
    other = tmp_path / "other-model"  # the same context, as if compressed for a wider model
    shutil.copytree(tmp_path / record.id, other)
    meta = json.loads((other / "kvjax_context.json").read_text())
    meta["config"]["d_model"] *= 2
    (other / "kvjax_context.json").write_text(json.dumps(meta))
    shutil.copy(tmp_path / f"{record.id}.json", tmp_path / "other-model.json")
    with caplog.at_level(logging.WARNING, logger="kvjax.serving.contexts"):
        restarted = ContextStore(tiny_llama, str(tmp_path), BIG)
    assert "other-model" in caplog.text
    assert restarted.records() == [record] and restarted.in_memory() == []
    assert_answers_like_fresh(tiny_llama, restarted.get(record.id), document(2), SNAPKV)
    assert restarted.in_memory() == [record.id]
    assert restarted.add(document(2), **SNAPKV) == (record, False)


def test_memory_keeps_the_most_recently_used_contexts_within_the_limit(tiny_llama, tmp_path):
    probe = ContextStore(tiny_llama, str(tmp_path / "probe"), BIG)
    size = probe.add(document(3), **SNAPKV)[0].bytes
    store = ContextStore(tiny_llama, str(tmp_path / "store"), size)
    a, _ = store.add(document(3), **SNAPKV)
    b, _ = store.add(document(4), **SNAPKV)
    assert a.bytes == b.bytes == size and store.in_memory() == [b.id]
    assert_answers_like_fresh(tiny_llama, store.get(a.id), document(3), SNAPKV)
    assert store.in_memory() == [a.id]
    assert_answers_like_fresh(tiny_llama, store.get(b.id), document(4), SNAPKV)
    assert store.in_memory() == [b.id] and store.usage()["loads_from_disk"] == 2
    small = ContextStore(tiny_llama, str(tmp_path / "store"), size - 1)  # none fits: served only
    assert_answers_like_fresh(tiny_llama, small.get(a.id), document(3), SNAPKV)
    assert small.in_memory() == []
    with pytest.raises(ValueError, match=r"memory_bytes \(--context-memory-mb\) must be >= 0"):
        ContextStore(tiny_llama, str(tmp_path / "store"), -1)


def test_a_deleted_context_is_gone_but_a_context_already_got_still_answers(tiny_llama, tmp_path):
    store = ContextStore(tiny_llama, str(tmp_path), BIG)
    record, _ = store.add(document(5), **SNAPKV)
    context = store.get(record.id)
    store.delete(record.id)
    assert stored(tmp_path) == [] and os.listdir(tmp_path) == []
    assert store.in_memory() == [] and store.records() == []
    for lookup in (store.get, store.record, store.delete):
        with pytest.raises(KeyError, match=record.id):
            lookup(record.id)
    assert_answers_like_fresh(tiny_llama, context, document(5), SNAPKV)
    assert ContextStore(tiny_llama, str(tmp_path), BIG).records() == []


def test_garbage_under_the_root_is_skipped(tiny_llama, tmp_path, caplog):
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "kvjax_context.json").write_text("{not json")
    (tmp_path / "stray.txt").write_text("x")
    with caplog.at_level(logging.WARNING, logger="kvjax.serving.contexts"):
        store = ContextStore(tiny_llama, str(tmp_path), BIG)
    assert store.records() == [] and "junk" in caplog.text and "empty" in caplog.text


def test_what_a_killed_write_leaves_is_removed_when_the_store_opens(tiny_llama, tmp_path, caplog):
    """The states a SIGKILL can leave a write in (tests/test_server_kills.py kills real servers):
    a half-filled temporary directory, a context directory renamed into place before its record,
    a record's temporary file, and a deletion cut between the record and the directory. A new
    store removes them, keeps the complete context and compresses the cut one again."""
    store = ContextStore(tiny_llama, str(tmp_path), BIG)
    done, _ = store.add(document(1), **SNAPKV)
    cut, _ = store.add(document(2), **SNAPKV)
    deleted, _ = store.add(document(3), **SNAPKV)
    os.remove(tmp_path / f"{cut.id}.json")  # renamed into place, record never written
    (tmp_path / f".{cut.id}.json.tmp4242").write_text('{"id": "')
    half = tmp_path / f".{done.id}.k2j3h4.tmp"  # atomic_directory's temporary, half-filled
    shutil.copytree(tmp_path / done.id, half)
    os.remove(half / "kvjax_context.json")
    os.remove(tmp_path / f"{deleted.id}.json")  # delete() removes the record first
    (tmp_path / "notes").mkdir()  # not the store's: skipped, kept
    with caplog.at_level(logging.WARNING, logger="kvjax.serving.contexts"):
        reopened = ContextStore(tiny_llama, str(tmp_path), BIG)
    assert reopened.records() == [done]
    assert sorted(os.listdir(tmp_path)) == sorted([done.id, f"{done.id}.json", "notes"])
    assert caplog.text.count("a write cut before it completed") == 4
    assert_answers_like_fresh(tiny_llama, reopened.get(done.id), document(1), SNAPKV)
    again, compressed = reopened.add(document(2), **SNAPKV)
    assert compressed and again.id == cut.id
    assert_answers_like_fresh(tiny_llama, reopened.get(cut.id), document(2), SNAPKV)


def test_tokens_must_be_one_document(tiny_llama, tmp_path):
    store = ContextStore(tiny_llama, str(tmp_path), BIG)
    with pytest.raises(ValueError, match="tokens"):
        store.add(np.stack([document(6), document(7)]), **SNAPKV)
    with pytest.raises(ValueError):  # longer than the model's context: kvjax.prefill's error
        store.add(np.full(tiny_llama.config.max_seq_len + 1, 10, np.int32), **SNAPKV)
    assert store.records() == [] and os.listdir(tmp_path) == []
