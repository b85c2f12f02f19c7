"""docs/lm.md's fine-tuning walk-through, run as written: its commands (the ``bash`` block after
``<!-- walkthrough -->``) and then its Python block, in a directory holding the tiny Llama and the tokenizer this
test makes (a byte-level BPE trained on the shipped text, saved into the model's directory)."""

from __future__ import annotations

import json
import re
import runpy
import shlex
from pathlib import Path

import pytest

from tests.conftest import SRC
from tests.helpers.cli_batch import run_here

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytestmark = pytest.mark.slow  # two fsdp workers import transformers

PAGE = Path(SRC).parent / "docs" / "lm.md"


def walkthrough() -> tuple[list[str], str]:
    """(the commands, one a string, continuation lines joined; the Python block after them)."""
    text = PAGE.read_text()
    after = text[text.index("<!-- walkthrough -->"):]
    commands = re.search(r"```bash\n(.*?)```", after, re.S).group(1).replace("\\\n", " ")
    code = re.search(r"```python\n(.*?)```", after, re.S).group(1)
    return [line.strip() for line in commands.splitlines() if line.strip()], code


def make_model_and_data(root: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from polytrain.data.text import shipped_text

    entries = [e.strip() for e in shipped_text().decode().split("\n\n") if e.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(entries[:300], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    model_dir = root / "models" / "tiny-llama"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="</s>").save_pretrained(model_dir)
    (root / "data").mkdir()
    (root / "data" / "entries.jsonl").write_text("".join(json.dumps({"text": e}) + "\n" for e in entries[300:500]))


def test_the_fine_tuning_walkthrough_runs_as_written(tmp_path, capsys, monkeypatch):
    """The commands through the command's own main and the Python block as a script, both in this process and in
    the directory the page's paths are relative to (what is tested is the page, not a fresh process: torch and
    transformers are imported once, not three times)."""
    pytest.importorskip("polytrain.weights.export", reason="waits for --save-model DIR (Hugging Face export)")
    import torch

    commands, code = walkthrough()
    assert [c.split()[:2] for c in commands] == [["polytrain", "train"], ["polytrain", "generate"]]
    make_model_and_data(tmp_path)
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for command in commands:
            done = run_here(capsys, *shlex.split(command)[1:])
            assert done.returncode == 0, f"{command}\nexit {done.returncode}:\n{done.stderr[-3000:]}"
            outputs.append(done.stdout)
        assert "packed documents: " in outputs[0] and (tmp_path / "finetuned" / "config.json").is_file()
        assert outputs[1].startswith("LOVE, n.")
        (tmp_path / "load.py").write_text(code)
        capsys.readouterr()
        runpy.run_path(str(tmp_path / "load.py"), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out.startswith("LOVE, n.")
