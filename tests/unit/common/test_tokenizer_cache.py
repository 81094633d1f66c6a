"""A GGUF file's tokenizer is built once, saved, and read back by later processes: the saved
one encodes, decodes and templates chats like the one built from the file; the key follows
the file; a cache that cannot be written changes nothing but the speed."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.model_spec import (
    ModelSource,
    forget_tokenizers,
    gguf_tokenizer_key,
    load_tokenizer,
    resolve_model,
)

TEXTS = [
    "Hello world!",
    "  def f(x):\n\treturn x**2  # ünïcödé 日本語 🙂",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("LLMSERVE_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))
    forget_tokenizers()  # the per-process memo would answer without the disk
    yield tmp_path / "tokenizers"
    forget_tokenizers()


def test_the_saved_tokenizer_behaves_like_the_built_one(cache: Path) -> None:
    source = resolve_model("smollm2")
    built = load_tokenizer(source)
    saved = list(cache.iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer.json").is_file()

    forget_tokenizers()
    reread = load_tokenizer(source)
    assert reread is not built
    for text in TEXTS:
        ids = built(text)["input_ids"]
        assert reread(text)["input_ids"] == ids
        assert reread.decode(ids) == built.decode(ids)
        assert reread.decode(ids, skip_special_tokens=True) == built.decode(
            ids, skip_special_tokens=True
        )
    chat = [{"role": "user", "content": "hi"}]
    assert reread.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        built.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    assert (reread.eos_token_id, len(reread)) == (built.eos_token_id, len(built))


def test_the_key_follows_the_file(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF one")
    first = gguf_tokenizer_key(gguf)
    assert gguf_tokenizer_key(gguf) == first
    os.utime(gguf, ns=(0, 10**18))
    assert gguf_tokenizer_key(gguf) != first


def test_an_unwritable_cache_still_gives_the_tokenizer(cache: Path) -> None:
    cache.parent.mkdir(exist_ok=True)
    cache.write_text("a file where the cache directory should be")
    tokenizer = load_tokenizer(resolve_model("smollm2"))
    assert tokenizer("Hello world!")["input_ids"] == [19556, 905, 17]
    assert cache.is_file()  # nothing was saved, and nothing broke


def test_threads_asking_at_once_share_one_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas warming up at once ask for their model's tokenizer together: one load."""
    import transformers

    loads = []

    def slow_load(path: str, **kwargs: object) -> object:
        loads.append(path)
        time.sleep(0.2)  # the other thread asks meanwhile
        return object()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", slow_load)
    forget_tokenizers()
    source = ModelSource("a-model", "/nonexistent/a-model")
    both_asking = threading.Barrier(2)
    got = []

    def ask() -> None:
        both_asking.wait()
        got.append(load_tokenizer(source))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    forget_tokenizers()
    assert loads == ["/nonexistent/a-model"] and len(got) == 2 and got[0] is got[1]
