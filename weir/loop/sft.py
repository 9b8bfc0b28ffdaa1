"""The SFT driver: supervised warm start on (prompt, response) rows, saved as an HF model directory."""

from __future__ import annotations

from pathlib import Path

from weir.adapters import adapter_sft_rows
from weir.config import Config
from weir.data.prompts import PromptTooLong
from weir.data.sources import load_rows
from weir.loop.components import PromptEncoder, load_run_model
from weir.loop.resume import say
from weir.loop.run import Run, run_dir_of
from weir.loop.selfcheck import check_packing, probe_length
from weir.tasks import get_task
from weir.train.model import eos_token_ids, save_model
from weir.train.sft import sft


def sft_examples(cfg: Config, tokenizer, eos: int) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(prompt_ids, response_ids + eos) pairs from sft.data or the task's SFT generator, and the
    number of rows skipped for prompts over data.max_prompt_tokens."""
    adapter = adapter_sft_rows(cfg)
    if cfg.sft.data is not None:
        rows = load_rows(cfg.sft.data)
    elif adapter is not None:
        rows = adapter
    elif cfg.data.task is not None:
        options = {
            **cfg.data.task_options,
            **cfg.sft.task_options,
        }  # same task, plus SFT-only options
        rows = get_task(cfg.data.task).sft_rows(cfg.sft.rows, cfg.run.seed, **options)
    else:
        raise ValueError(
            "no SFT data: set sft.data to a JSONL/Parquet file of {prompt, response} or data.task"
        )
    encode = PromptEncoder(cfg, tokenizer)
    out, skipped = [], 0
    for i, row in enumerate(rows):
        if "response" not in row:
            raise ValueError(f"SFT row {i} has no 'response' field (keys: {sorted(row)})")
        try:
            prompt, vision = encode.encode(row)
        except PromptTooLong:  # data.on_long_prompt=skip
            skipped += 1
            continue
        response = tokenizer(str(row["response"]), add_special_tokens=False)["input_ids"]
        out.append(
            (prompt, [*response, eos]) if vision is None else (prompt, [*response, eos], vision)
        )
    return out, skipped


def run_sft(cfg: Config) -> Path:
    """Warm-start `cfg.model.path` on SFT data; returns the saved model directory (<run dir>/model)."""
    model, tokenizer = load_run_model(cfg, run_dir_of(cfg))
    if cfg.lora.enabled:
        say("lora.* applies to weir train; weir sft trains every weight (the adapters' base)")
    if cfg.model.selfcheck:  # the packing half of the start-up self-check (SFT has no engine)
        limit = int(getattr(model.config, "max_position_embeddings", 2048))
        avoid = {tokenizer.pad_token_id, *eos_token_ids(model, tokenizer)}
        vocab = int(model.get_output_embeddings().weight.shape[0])
        check_packing(model, cfg.train, vocab, avoid, probe_length(model, limit))
    eos = (
        tokenizer.eos_token_id
        if tokenizer.eos_token_id is not None
        else eos_token_ids(model, tokenizer)[0]
    )
    examples, skipped = sft_examples(cfg, tokenizer, eos)
    total = -(-len(examples) // cfg.sft.batch_size) * cfg.sft.epochs
    every = max(1, total // 10)
    run = Run.open(cfg, total_steps=total, resumable=False)
    try:

        def on_step(step: int, total: int, metrics: dict[str, float]) -> None:
            if step % every == 0 or step == total:
                run.log(step, metrics, {"sft/skipped_long_prompts": float(skipped)})

        sft(
            model.train(),
            examples,
            cfg.sft,
            seed=cfg.run.seed,
            micro_batch_tokens=cfg.train.micro_batch_tokens,
            packing=cfg.train.packing,
            on_step=on_step,
        )
        return save_model(model.eval(), tokenizer, run.dir / "model")
    finally:
        run.close()
