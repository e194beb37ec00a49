"""The README's main job: its command runs `examples/train.py`, which fuses a Hugging Face GPT-2
(or, with `--model llama`, a Llama) built from its config, trains it beside the unfused model
and prints the report, the losses side by side and the speed. Nothing else in the suite runs the
script, so a change that broke it (an argument renamed, a report line moved, a pattern that no
longer matches HF's block) would reach a user's first command unseen."""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The families each tiny model's report must name as replaced: every block's and the head's loss.
FAMILIES = {
    "gpt2": ("attention", "bias_gelu", "layer_norm", "residual_stream", "dropout_add", "cross_entropy"),
    "llama": ("attention", "rms_norm", "rotary", "gated_activation", "residual_stream", "cross_entropy"),
}


def test_the_readme_main_command_runs_examples_train():
    """The README's first command (the main job) ends in the script the test below runs."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.DOTALL)
    assert blocks, "README.md has no bash block"
    assert blocks[0].rstrip().endswith("python examples/train.py"), blocks[0]


@pytest.mark.parametrize("model", list(FAMILIES))
def test_examples_train_fuses_the_model_and_trains_it_beside_the_unfused_one(model):
    """`python examples/train.py --model M --steps 2` as a user runs it on a CPU (kernels in the
    interpreter; the README names both models): it exits 0; the report names every family as
    replaced in the blocks and the head; each step's fused loss is finite and near the unfused one
    (GPT-2's dropout draws other masks: near, not equal; the losses start at ln(256) = 5.55 for
    random weights over a 256-token vocabulary); it prints the set-up time and both tokens/s."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTEST_XDIST_WORKER", None)
    command = [sys.executable, "examples/train.py", "--model", model, "--steps", "2"]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    text = out.stdout
    assert out.returncode == 0, (text + out.stderr)[-4000:]
    replaced = {line.split()[1] for line in text.splitlines() if line.strip().startswith("replaced")}
    assert set(FAMILIES[model]) <= replaced, f"replaced: {sorted(replaced)}\n{text[-3000:]}"
    # no call ran the original forward, and no rewrite failed
    assert not re.search(r"^\s+unfused: |rewrite failed|fell back", text, re.MULTILINE), text[-3000:]
    rows = re.finditer(r"^\s+\d+\s+(\S+)\s+(\S+)$", text, re.MULTILINE)
    losses = [tuple(map(float, m.groups())) for m in rows]
    assert len(losses) == 2, text[-3000:]
    for fused, unfused in losses:
        near = abs(fused - unfused) < 0.1 and abs(fused - math.log(256)) < 0.5
        assert math.isfinite(fused) and near, losses
    assert re.search(r"^fuse\(\) took [\d.]+ s", text, re.MULTILINE), text[-2000:]
    assert re.search(r"^tokens/s: fused [\d,]+, unfused [\d,]+", text, re.MULTILINE), text[-2000:]
