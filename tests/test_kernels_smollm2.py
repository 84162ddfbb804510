"""The whole SmolLM2 model with the Pallas kernels (``impl="pallas"``: the TPU kernels under the
Pallas interpreter on CPU) generates the XLA path's tokens, with a budget small enough that the chat
prompt is evicted block by block and every decode step evicts; and ``impl`` is validated."""

import numpy as np
import pytest

import kvjax

PROMPT = "Name the three primary colours and say which two of them make green when mixed."
EVICTION = dict(
    budget=32, block_size=16, obs_window=8
)  # window 8 + 4 sinks: 20 slots scored per step


@pytest.mark.smollm2
@pytest.mark.parametrize("scorer", ["snapkv", pytest.param("momentkv", marks=pytest.mark.slow)])
def test_pallas_generation_equals_xla(smollm2, smollm2_tokenizer, scorer):
    ids = kvjax.chat_tokens(smollm2_tokenizer, PROMPT)
    assert 40 <= len(ids) <= 64, len(ids)  # more than the budget: evicted while prefilling
    xla = kvjax.generate(smollm2, ids, 4, scorer=scorer, impl="xla", **EVICTION)
    pallas = kvjax.generate(smollm2, ids, 4, scorer=scorer, impl="pallas", **EVICTION)
    np.testing.assert_array_equal(pallas, xla)
    # the kernels did run: the compressed context's logits are close to XLA's, not the same bits
    logits = {
        impl: np.asarray(kvjax.prefill(smollm2, ids, scorer=scorer, impl=impl, **EVICTION).logits)
        for impl in ("xla", "pallas")
    }
    assert not np.array_equal(logits["pallas"], logits["xla"])
    np.testing.assert_allclose(
        logits["pallas"], logits["xla"], atol=1e-3 * np.abs(logits["xla"]).max()
    )


def test_impl_is_validated(tiny_llama):
    with pytest.raises(ValueError, match=r"impl='triton' must be one of \(None, 'xla', 'pallas'"):
        kvjax.generate(tiny_llama, [5, 6, 7], 2, budget=16, scorer="tova", impl="triton")
