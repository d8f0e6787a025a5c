"""Every bad input of docs/bad_input.md, each row a test.

ROWS below is the table: an id, what was wrong and the error a user sees. Rows
checked here run either in-process (argument checks that happen before any
communication), in one 2-rank torchrun job (world size, replicas, hostile peers
that send malformed metadata), or through the CLI. Rows tested elsewhere name
their test, which must exist. test_docs_table_lists_every_row keeps the
document and this list the same.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _multiprocess import ROOT, CaseRef, Cases, Launch, parametrize_cases, worker_main

DOC = os.path.join(ROOT, "docs", "bad_input.md")

# (id, bad input, the error a user sees (a regex found in the message), where it is tested)
ROWS: List[Tuple[str, str, str, str]] = [
    # -- arguments, rejected before any communication (in-process here)
    ("not-sequential", "`module` is not an `nn.Sequential`",
     r"module must be an nn\.Sequential \(got Linear\); wrap your layers in torch\.nn\.Sequential", "here"),
    ("schedule-name", "unknown schedule `1f1c`",
     r"schedule '1f1c' is not supported by the runtime; choose one of gpipe, 1f1b", "here"),
    ("microbatches", "`microbatches=0`", r"microbatches must be a positive integer or 'auto' \(got 0\)", "here"),
    ("chunks", "`chunks=2` with `1f1b`", r"chunks=2 needs schedule='interleaved-1f1b'", "here"),
    ("v-chunks", "`schedule='zbv'` (or `dualpipev`) without `chunks=2`",
     r"schedule 'zbv' places exactly 2 chunks per rank in a V \(rank r holds stages r and 2p-1-r; "
     r"got chunks=1\); use chunks=2", "here"),
    ("vertical-sync", "`vertical_sync=True` with `1f1b`", r"vertical_sync=True needs schedule='pipedream'", "here"),
    ("timeout", "`timeout=0`", r"timeout must be a finite number of seconds > 0 \(got 0\)", "here"),
    ("timeout-inf", "`timeout=float('inf')`",
     r"timeout must be a finite number of seconds > 0 \(got inf\): every wait on another rank "
     r"needs a bound", "here"),
    ("loss-reduction", "`loss_reduction='max'`", r"loss_reduction='max'; use 'mean'", "here"),
    ("tokens-async", "`loss_reduction='tokens'` with `pipedream` (an asynchronous schedule)",
     r"loss_reduction='tokens' divides by the token count of the whole batch before its backwards, "
     r"but schedule 'pipedream' updates the weights inside the pipeline.*use a flush schedule", "here"),
    ("tokens-fn-reduction", "`tokens_fn=` without `loss_reduction='tokens'`",
     r"tokens_fn=.* counts the tokens loss_reduction='tokens' divides by, but "
     r"loss_reduction='mean'; pass loss_reduction='tokens' or drop tokens_fn", "here"),
    ("balance-string", "`balance='4,4'` (a string that is neither `'auto'` nor a plan file)",
     r"balance='4,4' is neither 'auto' nor a plan file \(no such file\); give layer counts as a "
     r"list \(balance=\[4, 4\]\)", "here"),
    ("autocast-dtype", "`autocast=torch.float64`", r"autocast=torch\.float64 is not a reduced-precision dtype", "here"),
    ("autocast-async-fp16", "`autocast=torch.float16` with `pipedream`", r"needs loss scaling", "here"),
    ("check-finite", "`check_finite='warn'`", r"check_finite='warn'; use None, 'raise' or 'skip'", "here"),
    ("recompute-type", "`recompute=[1, 0]` (not bools) or `recompute=[]`",
     r"recompute=\[1, 0\] must be True, False or a list of one bool per stage", "here"),
    ("clip-option-flush", "`clip_grad_norm=1.0` with `1f1b` (a flush schedule)",
     r"clip_grad_norm=1\.0 is for asynchronous schedules, which step the optimizer themselves; with "
     r"schedule '1f1b' you step it: call pd\.clip_grad_norm_\(pipe, max_norm\) between pipe\.step\(x, y\) "
     r"and opt\.step\(\)", "here"),
    ("clip-option-value", "`clip_grad_norm=(1.0, 0)` with `pipedream` (a bad `norm_type`)",
     r"clip_grad_norm norm_type=0: use a p-norm with p > 0", "here"),
    ("option-name", "a misspelt option, `PipeDream(model, loss_fn, microbatch=4)`",
     r"PipeDream\(\) got an unexpected keyword argument 'microbatch'; did you mean 'microbatches'\?",
     "tests/test_units.py::test_options_positional_use_warns_and_unknown_names_are_refused"),
    ("no-launcher", "no process group and no torchrun environment",
     r"no torch\.distributed process group and no torchrun environment", "here"),
    ("init-seed", "`init_seed=-1`", r"init_seed=-1 is not an integer in \[0, 2\*\*16\)", "here"),
    ("meta-auto-balance", "`balance='auto'` with a model on the meta device",
     r"balance='auto' profiles the model, which cannot run on the meta device", "here"),
    # -- the planner's choices (schedule="auto", microbatches="auto", recompute="auto", memory=)
    ("auto-no-sample", "`schedule='auto'` (or `microbatches`, `recompute`) without `sample`",
     r"schedule='auto' measures the model's layers on one batch: pass sample=\(inputs, targets\)", "here"),
    ("auto-split-points", "`microbatches='auto'` with `split_points=` (stages fixed)",
     r"microbatches='auto': the planner cuts an nn\.Sequential's layers or a traced model's groups; "
     r"with split_points the stages are fixed", "here"),
    ("auto-replicas", "`schedule='auto'` with `replicas=`",
     r"schedule='auto': the search runs straight stages \(data parallelism: mesh=\); drop replicas", "here"),
    ("auto-asynchronous", "`microbatches='auto'` with `schedule='pipedream'`",
     r"microbatches='auto': the planner predicts flush schedules, but schedule='pipedream' is "
     r"asynchronous", "here"),
    ("auto-mesh", "`mesh='auto'` without `sample` (one step's batch of the whole run)",
     r"mesh='auto' measures the model's layers on one batch: pass sample=\(inputs, targets\), one "
     r"step's batch of the whole run", "here"),
    ("auto-mesh-split-points", "`mesh='auto'` with `split_points=` (stages fixed)",
     r"mesh='auto': the planner cuts an nn\.Sequential's layers or a traced model's groups; with "
     r"split_points the stages are fixed", "here"),
    ("auto-mesh-fsdp-options", "`mesh='auto'` with `reshard_after_forward` or `mp_policy`",
     r"mesh='auto' with mp_policy or reshard_after_forward is not supported", "here"),
    ("auto-mesh-factorisation", "`mesh='auto'` and no `(pp, dp, tp)` fits the layers and the rows",
     r"mesh='auto' finds no \(pp, dp, tp\) for 2 ranks: pp must be at most the model's 1 layers, "
     r"dp must divide the sample's 3 rows", "here"),
    ("auto-data-parallel-no-mesh", "`data_parallel='auto'` without a mesh",
     r"data_parallel='auto' chooses how a mesh's 'dp' ranks hold the stages, but there is no mesh",
     "here"),
    ("memory-value", "`memory=-1`", r"memory must be bytes per rank > 0, or None for no limit \(got -1\)", "here"),
    ("memory-nothing-searched", "`memory=` with every choice fixed",
     r"memory=8000000000\.0 limits what the planner chooses, but every choice is fixed", "here"),
    ("memory-nothing-fits", "`memory=` below what any configuration needs",
     r"memory", "tests/test_runtime.py::check_memory_forces_recompute"),
    ("plan-configuration-differs", "an option given otherwise than a plan file's configuration",
     r"schedule='gpipe' differs from the plan's configuration \(schedule='1f1b'\); drop schedule",
     "tests/test_runtime.py::check_auto_configuration"),
    # -- deferred initialisation and load_state_dict (every rank raises the same error)
    ("meta-no-reset", "a module on the meta device without `reset_parameters()`, no `init_fn`",
     r"module '1\.1' \(Scale: gain\) has parameters or buffers on the meta device but no "
     r"reset_parameters\(\)", "tests/test_deferred_init.py::test_meta_pipelines_train_like_the_unsplit_model_and_refuse_bad_input"),
    ("meta-unset-buffer", "a buffer computed in `__init__` (a causal mask) on the meta device",
     r"'2\.mask' on the meta device were not set by reset_parameters\(\)", "tests/test_deferred_init.py::test_meta_pipelines_train_like_the_unsplit_model_and_refuse_bad_input"),
    ("meta-traced-no-init", "a traced model (`split_points`) on the meta device with a module "
     "owning tensors but no `reset_parameters()`, no `_init_weights` on the model and no `init_fn`",
     r"module 'scale' \(Scale: weight\) of NetWithScale has parameters or buffers on the meta "
     r"device but no reset_parameters\(\)",
     "tests/test_traced_meta.py::test_meta_model_without_an_init_rule_is_refused_naming_the_module"),
    ("meta-traced-constant", "a traced model on the meta device whose graph holds a tensor that is "
     "no parameter or buffer (a plain tensor attribute)",
     r"'table' is on the meta device but is no parameter or buffer of the model",
     "tests/test_traced_meta.py::test_a_constant_traced_on_meta_is_refused_naming_it"),
    ("meta-assigned-buffer", "`init_fn` (or `reset_parameters()`) assigns a buffer anew "
     "(`layer.freqs_cis = precompute()`) with another shape or dtype than the meta tensor's (the same: kept)",
     r"layer 0 \('0'\): init_fn assigned the buffer '0\.tab' a tensor of shape \[3, 4\] and dtype "
     r"torch\.float32, but the model built on the meta device has shape \[2, 4\]",
     "tests/test_units.py::test_initialisation_may_assign_a_buffer_anew"),
    ("meta-unset-at-step", "a tensor of a meta-built model nothing set: `init_fn` skipped it and no "
     "`load_state_dict` (or a partial one, `strict=False`) brought it",
     r"step\(\): tensors built on the meta device were never set \(they still hold the NaN, for "
     r"integers the 0xA5 bytes, every new tensor starts as\): rank 0: '0\.bias', '2\.bias'; rank 1: "
     r"'4\.bias', '6\.bias', '7\.bias'; nothing set them",
     "tests/test_deferred_init.py::test_meta_pipelines_train_like_the_unsplit_model_and_refuse_bad_input"),
    ("state-dict-unexpected", "`load_state_dict` with another model's state dict",
     r"the state dict has 3 key\(s\) this model does not have: '1\.weight', '1\.bias', 'head\.bias'",
     "tests/test_deferred_init.py::test_meta_pipelines_train_like_the_unsplit_model_and_refuse_bad_input"),
    ("state-dict-missing", "`load_state_dict` without a key of a stage",
     r"the state dict lacks 1 key\(s\) of stage 1 \(layers 4-7\): '6\.bias' \(missing keys\)", "tests/test_deferred_init.py::test_meta_pipelines_train_like_the_unsplit_model_and_refuse_bad_input"),
    ("state-dict-shape", "`load_state_dict` with a tensor of another shape",
     r"'7\.weight' has shape \[4, 12\] but this model's is \[3, 12\]", "tests/test_deferred_init.py::test_meta_pipelines_train_like_the_unsplit_model_and_refuse_bad_input"),
    ("state-dict-meta", "`load_state_dict` with the state dict of a model built on the meta device (any `strict`)",
     r"state dict entries '0\.weight', '0\.bias', '2\.weight', '2\.bias', '3\.weight', '3\.bias', "
     r"'3\.running_mean', '3\.running_var' and 7 more are on the meta device, which has shapes but no values",
     "tests/test_deferred_init.py::test_a_meta_models_state_dict_is_refused_naming_its_entries"),
    ("load-copies", "`load_state_dict` (or `load_checkpoint`) that would leave copies of one tensor different: a state dict whose replicated norm weight differs per tp rank, or different values under two names of a tied parameter",
     r"the copies of '[\w.]+'( \(shard [\w=,]+\))? would differ after the load \(.*\); they are one tensor \(tied, replicated over dp or tp, or one shard held by several ranks\) and would train apart",
     "tests/test_tp_checkpoint.py::test_tensor_parallel_checkpoints"),
    ('hf-unexpected', "`pipe.load_state_dict(hf_dir)` with another model's weights (or `LlamaModel`'s for a `LlamaForCausalLM`)",
     r"holds 38 tensor\(s\) this model does not have: 'embed_tokens.weight'", 'tests/test_hf_weights.py::test_unexpected_and_mis_shaped_keys_are_named'),
    ('hf-missing', "`pipe.load_state_dict(hf_dir)` lacking a tensor of a stage (an untied head given a tied model's files)",
     r"lacks 1 tensor\(s\) of stage 0 \(layers 0-0\): 'lm_head.weight' \(missing keys\)", 'tests/test_hf_weights.py::test_tied_head_is_read_under_the_embedding_name'),
    ('hf-shape', '`pipe.load_state_dict(hf_dir)` of a model with another configuration',
     r"'model.embed_tokens.weight' has shape \[80, 32\] in model-\d+-of-\d+.safetensors but this model's", 'tests/test_hf_weights.py::test_unexpected_and_mis_shaped_keys_are_named'),
    ('hf-index', 'a `model.safetensors.index.json` without a `weight_map`, or naming a file elsewhere',
     r"is not a safetensors index \(no 'weight_map'", 'tests/test_hf_weights.py::test_index_is_parsed_and_a_bad_one_named'),
    ('hf-shard-missing', 'a shard the index lists is not in the directory',
     r'is missing: .* lists it in model.safetensors.index.json but it is not there', 'tests/test_hf_weights.py::test_a_shard_the_index_lists_must_be_there'),
    ("hf-damaged", "a damaged `.safetensors` file (truncated, a huge header, overlapping offsets, a pickle renamed)",
     r"is not a readable safetensors file \(reading tensor 'model\.norm\.weight'\): .*download or copy it again",
     "tests/test_hf_weights.py::test_a_damaged_safetensors_file_is_named_with_the_tensor"),
    ('hf-not-weights', '`pd.detect` (and `pipe.load_state_dict`) of a path that is no checkpoint, Hugging Face directory or torch file',
     r'not a format pipedream_ext reads; pass a checkpoint directory', 'tests/test_hf_weights.py::test_detect_names_each_format'),
    ('hf-out-dir', '`pd.save_pretrained` or `consolidate(format="hf")` into a directory holding other files '
     "(a tokenizer, a README, `runs/`, a project's `src/` with `out_dir=\".\"`) or a previous save (which was "
     "replaced whole, those files with it)",
     r"none: the model's files are added and the others kept; only the previous save's "
     r"model-\*-of-\*\.safetensors the new index does not name are removed",
     'tests/test_hf_weights.py::test_save_pretrained_into_a_project_on_one_rank'),
    ('hf-out-file', '`pd.save_pretrained` or `consolidate(format="hf")` with `out_dir` an existing file',
     r'exists and is not a directory; pass a directory \(new, or one to add the model\'s files to\)',
     'tests/test_hf_weights.py::test_out_dir_through_a_link_and_the_refusals'),
    ('hf-out-link', '`out_dir` a symbolic link to a directory that does not exist (a link to a directory is '
     'written through and stays a link)',
     r'is a symbolic link to .*, which does not exist; create that directory or pass another out_dir',
     'tests/test_hf_weights.py::test_out_dir_through_a_link_and_the_refusals'),
    ('hf-out-single', "`out_dir` holds a `model.safetensors` (transformers' single-file save), which "
     "`from_pretrained` would load instead of the new shards",
     r'holds model\.safetensors \(a single-file save\), which from_pretrained would load instead of the new '
     r'shards and model\.safetensors\.index\.json; move or delete it',
     'tests/test_hf_weights.py::test_out_dir_through_a_link_and_the_refusals'),
    ('consolidate-format', '`pd.consolidate(ckpt, format="safetensors")`, or `format="hf"` without `out_dir`',
     r"consolidate\(format='safetensors'\): use format=None", 'tests/test_hf_weights.py::test_consolidate_arguments_are_checked'),
    # -- world, balance, replicas (2 ranks)
    ("balance-count", "`balance` lists 3 stages on 2 ranks",
     r"balance lists 3 stages but the world has 2 ranks x 1 chunks = 2 stages", "here"),
    ("balance-sum", "`balance` does not add up to the layers", r"balance \[2, 9\] sums to 11 but the model has 4 layers", "here"),
    ("balance-empty", "a stage with no layers", r"balance \[0, 4\] has a stage with no layers", "here"),
    ("world-size", "`replicas=[2, 1]` on 2 ranks", r"replicas \[2, 1\] need 3 ranks but the world has 2", "here"),
    ("replicas-zero", "`replicas=[0, 2]`", r"replicas \[0, 2\] has a count below 1", "here"),
    ("too-few-layers", "more stages than layers", r"the model has 1 layers but 2 stages are needed", "here"),
    ("config-mismatch", "ranks built with different arguments", r"ranks disagree on the pipeline configuration", "here"),
    ("recompute-stages", "`recompute=[True, False, True]` on 2 stages",
     r"recompute=\[True, False, True\] lists 3 stages but the pipeline has 2; give one bool per "
     r"stage, or True / False for all", "here"),
    ("recompute-rank", "`recompute=[True, True, False, False]` with `zbv` on 2 ranks (rank 0 runs "
     "stages 0 and 3)",
     r"recompute=\[True, True, False, False\] recomputes some but not all of stages \[0, 3\], which "
     r"rank 0 runs \(schedule 'zbv', chunks=2\); a rank recomputes all its stages or none", "here"),
    # -- every rank agrees: the same graph, model, calls and batch (tests/test_agreement.py)
    ("graph-mismatch", "a traced forward that differs by rank (split points, chunks, replicas or `balance='auto'`)",
     r"ranks traced different graphs: stage 0 differs between rank 0 and rank 1: rank 1 has "
     r"`tanh = call_function tanh\(a\)` where rank 0 has `relu = call_function relu\(a\)`",
     "tests/test_agreement.py::test_ranks_must_agree_on_graph_batch_and_loss"),
    ("graph-constant-mismatch", "a config that differs by rank (another RoPE base: a buffer the graph reads)",
     r"rank 1 has `model_rotary_emb_inv_freq = get_attr model.rotary_emb.inv_freq \(tensor "
     r"torch.float32\[4\], value \w+\)\(\)",
     "tests/test_agreement.py::test_ranks_must_agree_on_graph_batch_and_loss"),
    ("model-mismatch", "an `nn.Sequential` with another layer on one rank (Tanh for ReLU)",
     r"ranks built different models: stage 0 differs between rank 0 and rank 1: rank 1 has "
     r"`layer 1, module '1': Tanh\(\)` where rank 0 has `layer 1, module '1': ReLU\(\)`",
     "tests/test_agreement.py::test_ranks_must_agree_on_graph_batch_and_loss"),
    ("model-wider", "a wider layer on one rank",
     r"rank 1 has `layer 0, module '0': Linear\(in_features=6, out_features=16, bias=True\) with "
     r"weight torch.float32\[16, 6\]",
     "tests/test_agreement.py::test_ranks_must_agree_on_graph_batch_and_loss"),
    ("batch-sampler", "a `DistributedSampler` kept from DDP: another batch on every rank",
     r"stage 0 on rank 0 and the last stage on rank 1 were given different batches \(targets "
     r"fingerprints \w+ and \w+\).*DistributedSampler\(dataset, num_replicas=1, rank=0",
     "tests/test_agreement.py::test_ranks_must_agree_on_graph_batch_and_loss"),
    ("batch-rows", "inputs and targets of different sizes on the first and last stage",
     r"stage 0 on rank 0 was given inputs of 8 rows but the last stage on rank 1 targets of 12 rows",
     "tests/test_agreement.py::test_ranks_must_agree_on_graph_batch_and_loss"),
    ("different-calls", "ranks in different calls at the first steps (`forward_only` on one, `step` on the other)",
     r'ranks are in different calls: "forward_only\(\) number 0" on rank 0; "step\(\) number 0" '
     r'on rank 1', "tests/test_agreement.py::test_ranks_must_agree_on_graph_batch_and_loss"),
    ("extra-step", "an extra `step()` on one rank later on (its peer between calls)",
     r"this rank is in step\(\) number 2, but rank 0 is not in a pipeline call \(it has made 2 "
     r"step\(\) calls\)",
     "tests/test_agreement.py::test_an_extra_step_on_one_rank_names_the_other_ranks_calls"),
    ("unflushed", "an asynchronous run ended without `flush()`",
     r"the asynchronous pipeline ends with 3 minibatches admitted and never flushed.*call "
     r"pipe\.flush\(\)",
     "tests/test_agreement.py::test_an_asynchronous_run_ended_without_flush_is_named_on_every_rank"),
    ("forward-only-merge", "a `forward_only` output whose dim 0 is not the batch (a `[10]` statistic over the "
     "rows, a sequence-first `[3, B, 10]`), or a bad `output_batch_dim`",
     r"forward_only\(\): output\[1\] has shape \[10\] in microbatch 0 of 4 rows \(the batch of 16 rows is cut "
     r"into 4 microbatches of 4, 4, 4, 4 rows along dim 0\), so its dim 0 is not a batch dimension .* pass "
     r"output_batch_dim=None / its dim 1 has each microbatch's rows: pass forward_only\(\.\.\., "
     r"output_batch_dim=1\)", "tests/test_runtime.py::test_flush_schedules_match_the_unsplit_model"),
    ("input-no-batch", "an input without the batch dimension (a memory bank)",
     r"inputs 1 \('bank'\) has 5 rows in dim 0 but the batch has 8 rows.*register it as a buffer",
     "tests/test_agreement.py::test_ranks_must_agree_on_graph_batch_and_loss"),
    ("loss-sum", "`loss_fn` with `reduction='sum'`",
     r"loss_fn sums over the batch.*pass loss_reduction='sum'",
     "tests/test_agreement.py::test_ranks_must_agree_on_graph_batch_and_loss"),
    ("loss-sum-mean", "`loss_reduction='sum'` with a mean-reduced `loss_fn`",
     r"loss_fn averages over the batch.*drop loss_reduction='sum'",
     "tests/test_agreement.py::test_ranks_must_agree_on_graph_batch_and_loss"),
    ("loss-float", "`loss_fn` returns a float (`.item()`) or a tuple",
     r"step\(\) number 0 failed on rank 1: loss_fn returned a (float|tuple) .*scalar tensor",
     "tests/test_agreement.py::test_ranks_must_agree_on_graph_batch_and_loss"),
    ("tokens-plain", "`loss_reduction='tokens'` with a `loss_fn` that returns a plain loss tensor",
     r"loss_reduction='tokens' needs loss_fn to return \(loss_sum, n_tokens\).*it returned a "
     r"Tensor of shape \(\)", "tests/test_token_loss.py::test_token_mean_matches_the_unsplit_model"),
    ("tokens-mean", "`loss_reduction='tokens'` with a `loss_fn` whose `loss_sum` is a mean",
     r"loss_fn's loss_sum averages over the batch.*sum over the tokens \(reduction='sum'\)",
     "tests/test_token_loss.py::test_token_mean_matches_the_unsplit_model"),
    ("tokens-none", "`loss_reduction='tokens'` on a batch without tokens (every target `-100`, on "
     "every dp rank), at any step", r"step\(\) number \d+: the batch holds no tokens: tokens_fn "
     r"counted 0 in every microbatch.*nothing ran on any rank",
     "tests/test_token_loss.py::test_token_mean_matches_the_unsplit_model"),
    ("tokens-fn-count", "`loss_reduction='tokens'` with a `tokens_fn` returning inf, NaN, a negative "
     "or a fractional count, at any step", r"tokens_fn counted inf tokens in microbatch 0; a token "
     r"count is a whole number >= 0", "tests/test_token_loss.py::test_token_mean_matches_the_unsplit_model"),
    ("tokens-count", "`loss_reduction='tokens'` with a `loss_fn` whose `n_tokens` is not what "
     "`tokens_fn` counts (a loss that shifts its labels, the default `tokens_fn`)",
     r"loss_fn returned n_tokens=\d+ for microbatch \d, but tokens_fn counted \d+ tokens in its "
     r"targets.*tokens_fn=lambda t: \(t\[:, 1:\] != -100\)\.sum\(\)", "tests/test_token_loss.py::test_token_mean_matches_the_unsplit_model"),
    ("tokens-tuple", "`loss_reduction='tokens'` with tuple targets and no `tokens_fn`",
     r"loss_reduction='tokens' counts the tokens of a target tensor.*the targets are a tuple; "
     r"pass tokens_fn=", "tests/test_token_loss.py::test_token_mean_matches_the_unsplit_model"),
    ("stage-dict", "a stage before the last returns a dict (or None)",
     r"rank 0: stage 0 \(layers 0-1\) returned a dict; a stage before the last must return a "
     r"tensor or a tuple of tensors",
     "tests/test_agreement.py::test_ranks_must_agree_on_graph_batch_and_loss"),
    ("auto-export-only", "`balance='auto'` on a model only torch.export traces (Llama)",
     r"balance='auto' and plan files cut torch\.fx graphs.*takes split_points=\[module names\] instead",
     "tests/test_agreement.py::test_auto_balance_of_an_export_only_model_names_split_points"),
    ("plan-ranks", "a plan whose stage `ranks` are not the runtime's placement",
     r"plan stage 0 lists ranks \[1\], but PipeDream runs stage j on the next replicas\[j\] ranks",
     "tests/test_units.py::test_a_plan_that_moves_stages_to_other_ranks_is_refused"),
    ("manifest-step", "a checkpoint manifest whose `step` is a string",
     r"'step' is '100' \(str\); it must be a non-negative integer or null",
     "tests/test_units.py::test_a_manifest_with_a_step_that_is_no_integer_is_refused"),
    ("clip-max-norm", "`pd.clip_grad_norm_(pipe, 0)` (`max_norm` <= 0, NaN or not a number)",
     r"max_norm=0: the largest gradient norm must be a number > 0",
     "tests/test_clip.py::test_clip_grad_norm_matches_torch_on_the_unsplit_model"),
    ("clip-norm-type", "`pd.clip_grad_norm_(pipe, 1.0, norm_type=0)` (or `-1`, `'two'`)",
     r"norm_type=0: use a p-norm with p > 0 \(2\.0, the default, or 1\.0\) or float\('inf'\)",
     "tests/test_clip.py::test_clip_grad_norm_matches_torch_on_the_unsplit_model"),
    ("clip-async-call", "`pd.clip_grad_norm_` on a `pipedream` or `pipedream-2bw` pipeline",
     r"schedule 'pipedream-2bw' steps the optimizer inside the pipeline, after pd\.clip_grad_norm_ could "
     r"run; clip there instead: PipeDream\(\.\.\., clip_grad_norm=1\.0\)",
     "tests/test_clip.py::test_clip_grad_norm_matches_torch_on_the_unsplit_model"),
    ("clip-option-steps", "`clip_grad_norm=` with `pipedream` (or `pipedream-2bw` with fewer microbatches "
     "than ranks)",
     r"clip_grad_norm with schedule 'pipedream', microbatches=2 and replicas \[1, 1\]: the ranks make "
     r"their k-th weight update in different step\(\) calls",
     "tests/test_clip.py::test_clip_grad_norm_matches_torch_on_the_unsplit_model"),
    ("shared-async", "a parameter shared by stages (tied weights) with `pipedream` or `pipedream-2bw`",
     r"parameter 0\.weight and 4\.weight \(stages 0 and 1\) is shared by layers on different stages, "
     r"but schedule 'pipedream(-2bw)?' .* need a flush schedule \(gpipe, 1f1b, interleaved-1f1b, zb-h1, "
     r"zbv, dualpipev, interleaved-zb\)",
     "tests/test_shared_params.py::test_tied_lm_matches_the_unsplit_model"),
    ("sample-aliased", "a `sample` whose inputs share memory (`z = zeros(...); sample=((z, z), z)`, a view "
     "of another input, the model's own weight or buffer)",
     r"none: each aliasing input is copied before tracing \(torch\.export merged them: nanoGPT trained on "
     r"targets as idx\)", "tests/test_traced.py::test_aliased_sample_inputs_trace_as_distinct_inputs"),
    ("compiled-model", "a model wrapped by `torch.compile` (nanoGPT's `compile=True`; split points named "
     "`_orig_mod.…`)",
     r"none: built on the model inside the wrapper, names its own; each stage compiled with the "
     r"wrapper's settings",
     "tests/test_user_code.py::test_a_compiled_model_runs_every_stage_compiled_and_trains_like_the_unsplit_model"),
    ("module-compile", "a model compiled in place (`model.compile()`) before `PipeDream`",
     r"Sequential\.compile\(\) compiled the whole model's call, which a pipeline never makes .*compile it "
     r"with model = torch\.compile\(model, \.\.\.\) instead, and PipeDream compiles every stage", "here"),
    ("plan-file", "`balance=` a file that is not a plan",
     r"notaplan0.json: not a pipedream_ext.plan v1 object|notaplan1.json: not a pipedream_ext.plan v1 object", "here"),
    ("traced-auto-no-sample", "`balance='auto'` for a model that is not an `nn.Sequential`, no `sample`",
     r"pass sample=\(inputs, targets\), one batch to trace \(and profile\) it on",
     "tests/test_graph_profile.py::test_pipedream_refuses_auto_balance_of_a_traced_model_without_a_usable_sample"),
    ("traced-plan-other-model", "a plan (`balance=`) of another model's graph profile",
     r"plan stage 1 lists node 'node99', which this model's graph profile does not have",
     "tests/test_graph_profile.py::test_plans_that_cannot_run_are_refused"),
    ("traced-plan-backwards", "a plan whose stages use a value before it is computed",
     r"operation 'layer1_0_conv1' \(stage 0\) uses 'relu', which stage 1 computes later",
     "tests/test_graph_profile.py::test_plans_that_cannot_run_are_refused"),
    # -- data
    ("missing-targets", "no targets on the last stage's rank", r"needs the targets",
     "tests/test_runtime.py::test_one_sided_bad_input_fails_everywhere"),
    ("small-batch", "a batch smaller than `microbatches`", r"smaller than microbatches=2",
     "tests/test_runtime.py::test_one_sided_bad_input_fails_everywhere"),
    ("tensor-count", "a stage is passed another number of tensors than on the first step",
     r"rank 0 sent 2 tensors \(Float\[2, 12, 8\], Float\[2, 12, 8\]\) but stage 1 was first given "
     r"1 tensor \(Float\[2, 16, 8\]\); shapes may change from step to step, but the number of tensors",
     "tests/test_variable_shapes.py::test_a_peer_sending_what_the_stage_cannot_use_fails_both_ranks"),
    ("optimizer-before-pipeline", "an optimizer built from the model before `PipeDream` (nanoGPT's order: "
     "`opt = AdamW(model.parameters())`, then `PipeDream(model, ...)`), at its first `opt.step()`",
     r"rank \d: the optimizer holds \d of its 6 parameters from the model given to PipeDream that this "
     r"rank's pipeline does not train, e\.g\. '\d\.weight' \(a layer of another rank's stage, trained "
     r"there\).*opt = torch\.optim\.AdamW\(pipe\.parameters\(\), \.\.\.\)", "here"),
    ("call-pipeline", "`pipe(x, y)`, calling the pipeline like a module",
     r"a PipeDream pipeline is not called like a module \(pipe\(x, y\)\): train on a batch with "
     r"loss = pipe\.step\(x, y\)", "tests/test_user_code.py::test_calling_the_pipeline_names_step_and_forward_only"),
    ("loss-shape", "`loss_fn` does not reduce to a scalar (raised on every rank at the step's end)", r"loss_fn returned a tensor of shape \(4,\); it must return a scalar", "here"),
    ("nan", "NaN or inf in a stage's output", r"NaN or inf first appeared in the forward output of stage 0",
     "tests/test_mixed_precision.py::test_mixed_precision_and_nonfinite_detection"),
    # -- peers that send the wrong metadata (a raw rank posing as stage 1)
    ("peer-magic", "a peer's header with a bad magic number",
     r"received a header with a bad magic number \(12345\); the peer is not running the same pipedream_ext schedule", "here"),
    ("peer-count", "a peer announces 99 tensors", r"header announces 99 tensors", "here"),
    ("peer-negative-size", "a peer announces a negative size", r"header announces a negative size -3", "here"),
    ("peer-dtype", "a peer announces an unknown dtype", r"header announces an unknown dtype 999", "here"),
    ("peer-order", "a peer sends another transfer than the one due (a different schedule or order)",
     r"rank 1 sent transfer F0:0 where this rank expected B0:0 \(the two ranks issue this pair's "
     r"transfers in different orders", "here"),
    ("peer-gradient-shape", "a peer sends a gradient of the wrong shape",
     r"rank 1 sent a gradient Float\[2, 99\] for output 0 of Float\[2, 12\]; every rank must run the same model", "here"),
    ("peer-dead", "a peer dies mid-step", r"failed or timed out .*is rank 1 alive",
     "tests/test_runtime.py::test_killed_rank_makes_the_others_fail_naming_it"),
    # -- files
    ("profile-corrupt", "a corrupt profile file", r"file:line and the field",
     "tests/test_planner.py::test_parse_errors_name_file_line_and_field"),
    ("plan-json", "a plan JSON with a bad field", r"the file and the field",
     "tests/test_planner.py::test_plan_json_errors_name_the_file_and_field"),
    ("plan-cli", "bad `plan` arguments (e.g. a missing profile)", r"error: ... none.txt (exit 2)", "tests/test_planner.py::test_cli_plan_errors"),
    ('plan-data-parallel', '`plan(..., data_parallel=0)` (or `True`, `2.0`)',
     'data_parallel=0 must be an integer >= 1 (data-parallel ranks per stage, the dp size of a (pp, dp) mesh); leave it None to plan without data parallelism inside stages',
     'tests/test_planner.py::test_data_parallel_bad_input_names_the_value_and_the_fix'),
    ('plan-sharding', "`plan(..., sharding='zero')`, or `sharding=` without `data_parallel`",
     "sharding='zero' is unknown; use 'fsdp' ... or 'replicate' / sharding='fsdp' applies to data-parallel ranks inside stages; pass data_parallel=N (the dp size of the mesh) too",
     'tests/test_planner.py::test_data_parallel_bad_input_names_the_value_and_the_fix'),
    ('plan-dp-options', "`data_parallel` with `straight=False`, `cost_model='pipedream'`, `two_bw=True` or `optimizer_state=-1`",
     "data_parallel=2 puts data-parallel ranks inside every stage, which replaces PipeDream's replicas ...; drop straight=False / ... default cost model, not 'pipedream' / ... drop two_bw / optimizer state -1 bytes per weight byte is invalid",
     'tests/test_planner.py::test_data_parallel_bad_input_names_the_value_and_the_fix'),
    ('plan-dp-bandwidth', '`data_parallel=2` with one bandwidth per pipeline level only',
     "data_parallel=2 with pipeline workers [2] needs 2 bandwidths, got 1 ([1000000000.0]): first the bytes/s among a stage's data-parallel ranks ..., then one per pipeline level",
     'tests/test_planner.py::test_data_parallel_bad_input_names_the_value_and_the_fix'),
    ('plan-dp-memory', "a memory limit only FSDP fits, planned with `sharding='replicate'`",
     "no partition fits the memory limit of 5000000000.000000 bytes per worker (2 workers x 2 data-parallel ranks, sharding 'replicate'); ... or use sharding 'fsdp' (divides weights, gradients and optimizer state by 2)",
     'tests/test_planner.py::test_data_parallel_memory_per_rank_and_a_limit_only_fsdp_fits'),
    ('plan-tensor-parallel', '`plan(..., tensor_parallel=0)` (or `True`, `2.0`); `sequence_parallel`, `tensor_parallel_bandwidth` or `tensor_parallel_all_reduces` without `tensor_parallel`; a tp bandwidth <= 0 or all-reduces < 0',
     "tensor_parallel=0 must be an integer >= 1 (tensor-parallel ranks per data-parallel rank of a stage, the tp size of a (pp, dp, tp) mesh); leave it None to plan without tensor parallelism / sequence_parallel=True applies to tensor-parallel ranks inside stages; pass tensor_parallel=T (the tp size of the mesh) too / tensor_parallel_bandwidth=0 must be a positive number of bytes/s among a stage's tp ranks, e.g. 1e11 for NVLink inside a node; ...",
     'tests/test_planner.py::test_tensor_parallel_bad_input_names_the_value_and_the_fix'),
    ('plan-tp-options', "`tensor_parallel` with `straight=False`, `cost_model='pipedream'` or `two_bw=True`",
     "tensor_parallel=2 with straight=False: stages are straight over the pipeline workers on a (pp, dp, tp) mesh; drop straight=False / ... with cost_model='pipedream': it is planned with the default cost model (PipeDream's optimizer knows no tensor parallelism); use cost_model='default' / ... with two_bw=True: a (pp, dp, tp) mesh runs flush schedules (one weight version); drop two_bw",
     'tests/test_planner.py::test_tensor_parallel_bad_input_names_the_value_and_the_fix'),
    ('plan-tp-memory', 'a memory limit tp fits only with sequence parallelism',
     "no partition fits the memory limit of ... bytes per worker (2 workers x 1 data-parallel ranks x 2 tensor-parallel ranks, sharding 'replicate'); raise the limit, add pipeline workers, or drop the limit, or use sequence parallelism (divides stashed activations by 2)",
     'tests/test_planner.py::test_tensor_parallel_fits_a_model_that_did_not_fit'),
    ('plan-straight-layers', "`plan(..., straight=True)` (or `data_parallel`) on more workers than the profile has layers",
     "a straight plan on 128 workers needs 128 stages (one per worker, each at least one layer), but the profile splits into at most 100 (100 planning states, 100 layers); plan on at most 100 workers, pass fewer_workers=True, or allow replicated stages (straight=False)",
     'tests/test_planner.py::test_straight_plans_need_a_state_per_worker'),
    ('plan-mesh', 'a plan with PipeDream replicas, or made for another dp size or for FSDP, run on a `(pp, dp)` mesh; a dp size that does not divide the world',
     "the plan replicates stages PipeDream's way (replicas [...]) ...; re-plan with data_parallel / the plan was made for 2 data-parallel ranks per stage with sharding 'fsdp', but the mesh has 2 with 'replicate' ... --data-parallel 2 --sharding replicate / data_parallel=3 must be a positive divisor of the world size 8",
     'tests/test_planner.py::test_mesh_planning_at_start_up'),
    ("schedule-text", "a schedule text with a bad action",
     r"schedule text line 1: cannot parse action '0Q0': unknown action kind", "here"),
    ("schedule-cli", "bad `schedule` arguments", r"error: ... (the value and the fix; exit 2)",
     "tests/test_schedules.py::test_cli_errors_exit_nonzero_with_the_value"),
    ("checkpoint-corrupt", "a missing, truncated or altered checkpoint file",
     r"CKPT is not a complete checkpoint: ... is missing / FILE does not match the sha256 in the manifest",
     "tests/test_checkpoint.py::test_resume_in_other_processes_equals_an_uninterrupted_run"),
    ("checkpoint-format", "`save_checkpoint(..., format='torch')`, or `async_save=True` without `format='dcp'`",
     r"format='torch' is not a checkpoint format; use 'pipedream' or 'dcp' / async_save=True needs format='dcp'",
     "tests/test_checkpoint_dcp.py::test_dcp_resume_on_other_world_sizes_and_failures"),
    ("dcp-corrupt", "a DCP checkpoint with a missing, truncated or altered file",
     r"DIR/__1_0.distcp (DCP data) has 100 bytes but the manifest says N: the file is truncated / "
     r"does not match the sha256",
     "tests/test_checkpoint_dcp.py::test_dcp_async_save_loads_into_another_balance_and_the_unsplit_model"),
    ("dcp-mismatch", "loading a DCP checkpoint of another model or optimizer",
     r"g000001-dcp has '2.bias', which this model does not have / '7.weight' has shape [3, 12] in the "
     r"checkpoint but [4, 12] in this model / holds the state of a torch.optim.sgd.SGD, not of a "
     r"torch.optim.adam.Adam",
     "tests/test_checkpoint_dcp.py::test_dcp_resume_on_other_world_sizes_and_failures"),
    ("dcp-untrusted-metadata", "a DCP checkpoint whose `.metadata` pickle references anything but DCP's "
     "metadata classes (a crafted payload)",
     r"\.metadata \(DCP metadata\) was refused: it references io\.open, which is not a class of DCP metadata",
     "tests/test_checkpoint_dcp.py::test_an_untrusted_dcp_checkpoint_runs_no_code"),
    ("dcp-untrusted-value", "a DCP checkpoint storing a value, or a model tensor declared as bytes, as a pickled payload",
     r"the value of 'optim\.param_groups\.0\.weight\.lr' cannot be loaded with torch\.load\(weights_only=True\) / "
     r"'0\.weight' is stored as BytesStorageMetadata, not as a tensor",
     "tests/test_checkpoint_dcp.py::test_an_untrusted_dcp_checkpoint_runs_no_code"),
    ("checkpoint-outside", "a checkpoint whose DCP metadata points to a data file outside it, or whose file or DCP "
     "directory is a symbolic link out of it",
     r"stores '0\.weight' in '\.\./\.\./outside/__0_0\.distcp', which is not a data file .*manifest\.json lists / "
     r"is a symbolic link to .*, outside .*: copy the file in instead of linking it",
     "tests/test_checkpoint_dcp.py::test_an_untrusted_dcp_checkpoint_runs_no_code"),
    ("dcp-async-failed", "the next save after an asynchronous save that failed",
     r"the asynchronous save of CKPT (generation 3) failed: ...",
     "tests/test_checkpoint_dcp.py::test_dcp_resume_on_other_world_sizes_and_failures"),
    ("checkpoint-path", "`save_checkpoint` or `load_checkpoint` given another path on one rank (`\"ckpt\"` "
     "on all but the last, `\"ckpt-typo\"` there)",
     r"saving checkpoint ckpt: the ranks were given different directories: /abs/ckpt \(given as 'ckpt'\) on "
     r"ranks 0, 1, 2; /abs/ckpt-typo \(given as 'ckpt-typo'\) on rank 3\. Every rank must pass the same "
     r"directory, on a file system all ranks share; nothing was written or deleted",
     "tests/test_checkpoint.py::test_resume_in_other_processes_equals_an_uninterrupted_run"),
    ("checkpoint-not-shared", "a checkpoint directory on a file system the ranks do not share",
     r"ckpt: g000002-stage001-model\.pt \(weights of stage 1\) is missing on rank 0, which writes the "
     r"manifest: the ranks wrote into different directories, or the directory is not on a file system all "
     r"ranks share; the manifest was not written and the previous checkpoint was kept",
     "tests/test_checkpoint.py::test_resume_in_other_processes_equals_an_uninterrupted_run"),
    ("dcp-save-failed", "a DCP save that fails on one rank (a full disk)",
     r"saving checkpoint ckpt failed on rank 1: DCP's save into ckpt/g000002-dcp failed: ... "
     r"\(g000002-dcp/ is removed; the previous checkpoint is kept\)",
     "tests/test_checkpoint_dcp.py::test_dcp_async_save_loads_into_another_balance_and_the_unsplit_model"),
    ("dcp-pending-at-exit", "a process that ends with an asynchronous save unfinished (no `result()`, "
     "no `pipe.close()`)",
     r"the asynchronous checkpoint save of ckpt \(generation 2\) was still pending at exit: finishing it "
     r"now \(every rank does; at most 300 s\) / ... was not finished: the process is ending with an uncaught "
     r"RuntimeError ... ckpt holds the previous checkpoint; call its result\(\) or pipe\.close\(\) on every rank",
     "tests/test_checkpoint_dcp.py::test_async_save_pending_at_exit_is_finished_or_named"),
    ('mesh-async', '`mesh=` with `pipedream` or `pipedream-2bw`',
     "schedule 'pipedream(-2bw)?' updates weights inside the pipeline, but mesh= with data_parallel='fsdp' synchronises gradients at the end of a flushed step; use a flush schedule",
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('mesh-replicas', '`replicas=` together with `mesh=`',
     "replicas=\\[1, 1\\] and mesh= both ask for data parallelism; drop replicas \\(mesh\\['dp'\\] runs every stage on dp ranks\\) or drop mesh",
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('mesh-process-group', '`process_group=` together with `mesh=`',
     "process_group= and mesh= both name the pipeline's ranks; drop process_group \\(the pipeline runs on mesh\\['pp'\\]\\)",
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('mesh-shape', 'a mesh that is not 2-D `("pp", "dp")` over every rank',
     "mesh has dimensions \\('dp',\\); PipeDream takes a 2-D mesh init_device_mesh\\(device_type, \\(pp, dp\\), mesh_dim_names=\\('pp', 'dp'\\)\\)",
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('tp-plan-unmatched', "a `tensor_parallel` plan pattern that names no module of any stage (`'*.attn.wz'`)",
     r"tensor_parallel pattern '[^']+' matches no module of any stage; patterns are fnmatch patterns over the original model's module names",
     'tests/test_tensor_parallel.py::test_tensor_parallel_matches_the_unsplit_model'),
    ('tp-plan-failed', "a `tensor_parallel` callable plan that raises on some ranks (before or after its own collectives)",
     r"applying the tensor_parallel plan failed on ranks? .*; a plan must do the same on every rank: a callable plan that raises or differs on some ranks leaves its tp peers waiting",
     'tests/test_tensor_parallel.py::test_tensor_parallel_matches_the_unsplit_model'),
    ('tp-plan-differs', "a `tensor_parallel` callable plan that splits a stage differently on one rank (reads the rank)",
     r"tensor_parallel split stage \d+ differently on its ranks: '[\w.]+' is .* on rank \d+ .* but .* on rank \d+ .*; a plan must split every stage alike on every rank",
     'tests/test_tensor_parallel.py::test_tensor_parallel_matches_the_unsplit_model'),
    ('tp-uneven', "a `tensor_parallel` plan that shards a dimension tp does not divide (`ColwiseParallel()` on a `Linear(16, 7)` over tp=2)",
     r"tensor_parallel shards '[\w.]+' \(shape \[\d+, \d+\]\) on dim \d, of size \d+, over tp=2, which does not divide it evenly.*: torch's sharding propagation then fails on some ranks only",
     'tests/test_tensor_parallel.py::test_tensor_parallel_matches_the_unsplit_model'),
    ('tp-plan-type', "a `tensor_parallel` plan value that is not a `ParallelStyle` (`{'*.attn.wq': 'colwise'}`), or a plan that is neither a dict nor a callable",
     r"tensor_parallel(\[.*\] = .*: a plan maps module-name patterns \(str, e\.g\. '\*\.attn\.wq'\) to torch ParallelStyles|=.*; give a dict \{pattern: ParallelStyle\} or a callable fn\(stage_module, tp_mesh\))",
     'tests/test_tensor_parallel.py::test_tensor_parallel_matches_the_unsplit_model'),
    ('tp-unsupported', '`tensor_parallel` with an asynchronous schedule (`pipedream`, `pipedream-2bw`)',
     r"tensor_parallel with schedule='[\w-]+' is not supported yet; use",
     'tests/test_tensor_parallel.py::test_tensor_parallel_matches_the_unsplit_model'),
    ('tp-callable-replay', "a callable `tensor_parallel` plan with `split_points` that does more than apply `ParallelStyle`s to the model's modules (sets an attribute, applies none, or a style to the whole model)",
     r"tensor_parallel=\S+ (changed \[.*\] of the model besides applying ParallelStyles|applied no ParallelStyle|applies \w+ to (the whole model|a \w+ not in the model)|applies two styles to)",
     'tests/test_tp_traced.py::test_tensor_parallel_on_a_traced_model'),
    ('tp-split-inside', "a split point inside a module a `tensor_parallel` pattern matches (`split_points=['layers.1.attention.wq']` with `'layers.*.attention'` in the plan)",
     r"split point '[\w.]+' is inside '[\w.]+', which tensor_parallel pattern '.*' keeps as one module call \(its style's hooks run on that call, so its operations stay in one stage\); split at '[\w.]+' or at a module outside it",
     'tests/test_tp_traced.py::test_tensor_parallel_on_a_traced_model'),
    ('tp-export-call', "a `tensor_parallel` or `expert_parallel` pattern matching a module of a model only torch.export traces whose call cannot be put back: it returns something other than a tensor or a tuple of tensors (`'layers.*.feed_forward'` returning a dict), or the graph uses a value computed inside it",
     r"expert_parallel / tensor_parallel keeps '[\w.]+' \(\w+\) as a module call, but the torch.export path cannot put this call back: ",
     'tests/test_tp_traced.py::test_tensor_parallel_on_a_traced_model'),
    ('tp-mesh', "`tensor_parallel` without a mesh, or with a mesh without a `'tp'` dimension (also with `expert_parallel`, whose mesh puts `'tp'` after `'ep'`); a `'tp'` dimension without `tensor_parallel`",
     r"(tensor_parallel= needs a( mesh with a)? 'tp'( mesh)? dimension|mesh has a 'tp' dimension of size \d+ but tensor_parallel= is not given)",
     'tests/test_tensor_parallel.py::test_tensor_parallel_matches_the_unsplit_model'),
    ('ep-mesh', "`expert_parallel` without a mesh, or with a mesh without an `'ep'` dimension; an `'ep'` dimension without `expert_parallel`",
     r"(expert_parallel= needs (a mesh with an 'ep' dimension|mesh_dim_names \('pp', 'ep'\) or \('pp', 'dp', 'ep'\))|mesh has an 'ep' dimension of size \d+ but expert_parallel= is not given)",
     'tests/test_expert_parallel.py::test_expert_parallel_on_a_traced_moe'),
    ('ep-plan-unmatched', "an `expert_parallel` plan pattern that names no module of the model (`'layers.*.moe.gate'`)",
     r"expert_parallel patterns? .* match(es)? no module of the model; patterns are fnmatch patterns over model.named_modules\(\) names",
     'tests/test_expert_parallel.py::test_expert_parallel_on_a_traced_moe'),
    ('ep-plan-type', "an `expert_parallel` plan value that is not a `ParallelStyle`, or a plan that is neither a dict nor a callable",
     r"expert_parallel(\[.*\] = .*: a plan maps module-name patterns|=.*; give a dict \{pattern: ParallelStyle\} or a callable fn\(stage_module, ep_mesh\))",
     'tests/test_expert_parallel.py::test_expert_parallel_on_a_traced_moe'),
    ('ep-unsupported', "`expert_parallel` with what it does not support yet: an asynchronous schedule, a meta-device model whose routing or experts cannot run on meta values (tracing fails), `mesh='auto'` with a callable plan",
     r"expert_parallel(=)? with .* is not supported yet",
     'tests/test_expert_parallel.py::test_expert_parallel_on_a_traced_moe'),
    ('ep-auto', "`expert_parallel=\"auto\"` for a model without a transformers `ep_plan`, or whose `ep_plan` names styles other than the experts' dispatch (`\"ep_dispatch_experts\"`) and stacked parameters (`\"grouped_gemm\"`)",
     r"expert_parallel='auto'(: | reads a transformers model's ep_plan, and )",
     'tests/test_expert_parallel.py::test_expert_parallel_on_a_traced_moe'),
    ('ep-routed-experts', "`RoutedExpertParallel` on a module whose expert count the ep size does not divide, without an integer `num_experts`, or with a parameter not stacked by expert",
     r"RoutedExpertParallel: \w+(\.\w+)? (has \d+ experts, which the ep size \d+ does not divide|has no integer num_experts|has shape)",
     'tests/test_expert_parallel.py::test_expert_parallel_on_a_traced_moe'),
    ('ep-checkpoint', "`save_checkpoint(format=\"pipedream\")` (the default) of a pipeline built with `expert_parallel`",
     r"does not support pipelines built with mesh= \(data_parallel='\w+'\): each ep rank holds other experts of its stage \(expert_parallel\); use save_checkpoint\(\.\.\., format='dcp'\)",
     'tests/test_expert_parallel.py::test_expert_parallel_on_a_traced_moe'),
    ('overlap-schedule', "`overlap=True` (or a hook) with a schedule other than `dualpipev`, or `overlap` neither a bool nor a function",
     r"overlap runs the F&B pairs of schedule='dualpipev' together; schedule '[\w-]+' has none: give schedule='dualpipev' \(chunks=2\) or overlap=False",
     'tests/test_expert_parallel.py::test_overlap_needs_dualpipev'),
    ('overlap-hook', "an `overlap=` hook (or a model's `overlapped_forward_backward`) that returns without running the pair's backward, runs `module0` other than once, or returns something other than its outputs",
     r"overlapped_forward_backward \w+ \(forward: stage \d+ microbatch \d+, backward: stage \d+ microbatch \d+\) returned without the backward reaching outputs1; call torch\.autograd\.backward\(outputs1, output_grads1\)",
     'tests/test_expert_parallel.py::test_an_overlap_hook_must_run_both_halves_once'),
    ('aux-loss-export', "`pd.add_aux_loss` in a model only torch.export traces (its forward has a branch fx cannot follow)",
     r"add_aux_loss cannot be traced by torch\.export \(it would keep the forward and drop the aux loss's gradient\); make the model traceable by torch\.fx",
     'tests/test_expert_parallel.py::test_add_aux_loss_is_one_node_under_fx_and_refused_by_export'),
    ('tp-tied', "a parameter tied across stages (an embedding/head tie) that `tensor_parallel` splits differently on its uses (`ColwiseParallel()` on the head, the embedding not split), including uses on one rank (`zbv`'s first and last stage), which then stay separate tensors",
     r"tensor_parallel (splits parameter .* tied across stages, differently on its uses: .*; its stages sum the tied gradients shard by shard|replaced the uses of parameter .*, tied across stages, by separate tensors on one rank)",
     'tests/test_tp_compose.py::test_tensor_parallel_composes'),
    ('tp-plan-mesh', "a saved plan (`balance=` a plan.json or `Plan`) made for another tp size than the mesh's: a `--tensor-parallel 2` plan on a `(pp, dp)` mesh, a mesh plan without tp on a `(pp, dp, tp)` mesh",
     r"the plan was made for \d+ tensor-parallel ranks per data-parallel rank \(a \(\d+, \d+, \d+\) \(pp, dp, tp\) mesh, stage 0 on ranks \[.*\]\), but the mesh has tp size \d+.*, so its memory and time per rank do not hold; re-plan with --data-parallel \d+ --sharding \w+",
     'tests/test_tp_planning.py::test_tp_planning_matches_the_unsplit_model'),
    ('tp-checkpoint', '`save_checkpoint(format="pipedream")` (the default) or `load_checkpoint` of a `format="pipedream"` checkpoint with `tensor_parallel`',
     r"save_checkpoint\(format='pipedream'\) does not support pipelines built with mesh= \(data_parallel='\w+'\): each tp rank holds shards of its stage \(tensor_parallel\); use save_checkpoint\(\.\.\., format='dcp'\)",
     'tests/test_tp_checkpoint.py::test_tensor_parallel_checkpoints'),
    ('tp-batch', 'the tp ranks of a dp coordinate given different batches (first steps)',
     r"the tp ranks of dp coordinate 0 were given different inputs \(fingerprints: .*\); tensor parallelism splits the weights, not the batch",
     'tests/test_tensor_parallel.py::test_tensor_parallel_matches_the_unsplit_model'),
    ('tp-batch-later', 'the tp ranks of a dp coordinate given different batches after the first `check_agreement` steps',
     r"step\(\) number \d+: the tp ranks of dp coordinate 0 were given different inputs \(fingerprints: tp 0 \(ranks .*\) [0-9a-f]+, tp 1 \(ranks .*\) [0-9a-f]+\), so each tp rank trained its shards on another batch",
     'tests/test_tensor_parallel.py::test_tensor_parallel_matches_the_unsplit_model'),
    ('tp-cut-placement', "a `DTensor` crossing a cut with another placement than the style on the receiving stage's first module declares (`PrepareModuleInput(input_layouts=Replicate())` after a `SequenceParallel()` norm)",
     r"stage 1 receives output 0 of stage 0 as a DTensor with Shard\(dim=1\), but its first module '4' has PrepareModuleInput with input_layouts Replicate\(\): make the plan agree on the cut",
     'tests/test_tp_sequence.py::test_sequence_parallel_across_cuts'),
    ('tp-sequence-length', 'a batch whose sequence length (dim 1 of the inputs) tp does not divide with a `SequenceParallel` style in the `tensor_parallel` plan',
     r"inputs have sequence length 5 \(dim 1 of shape \[8, 5\]\), which does not split evenly over tp=2: tensor_parallel's SequenceParallel styles shard the sequence over the tp ranks in equal parts; use a sequence length divisible by 2 \(pad it to 6\)",
     'tests/test_tp_sequence.py::test_sequence_parallel_across_cuts'),
    ('tp-cut-dtensor', "a `DTensor` at a cut that cannot cross: sharded unevenly, over another mesh than `mesh['tp']`, another placement than `Replicate`/`Shard`/`Partial`, or placements that change between forwards",
     r"stage 0 returns a DTensor \(output 0, placements \(Shard\(dim=2\),\), shape .*\): dim 2 \(7\) does not split evenly over tp=2; the receiving stage rebuilds the DTensor from its local shard",
     'tests/test_tp_sequence.py::test_sequence_parallel_across_cuts'),
    ('tp-dtensor-end', 'the last stage returning a `DTensor` (loss parallelism: the head with `use_local_output=False`) with `tensor_parallel`',
     r"the last stage \(stage 3\) returns a DTensor \(output 0, placements \(Shard\(dim=2\),\)\): loss_fn and the caller get plain tensors \(loss parallelism is not supported yet\)",
     'tests/test_tp_sequence.py::test_sequence_parallel_across_cuts'),
    ('data-parallel', "`data_parallel='ddp'`",
     "data_parallel='ddp'; use 'fsdp' \\(FSDP2 over mesh\\['dp'\\]\\) or 'replicate'",
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('fsdp-without-mesh', '`reshard_after_forward=True` or `mp_policy=` without `mesh=`',
     "mp_policy and reshard_after_forward configure FSDP over a mesh's 'dp' dimension: pass mesh=init_device_mesh",
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('mesh-plan-traced', "`balance='auto'` or a plan of a model that is not an `nn.Sequential`, with `mesh=`",
     "balance='auto' or a plan of a traced model (not an nn.Sequential) with mesh= ... is not supported",
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('fsdp-split-tie', "a parameter tied between two FSDP units of one pipeline rank with `data_parallel='fsdp'`",
     "parameter 0.0.weight = 6.0.weight is used by layer 0 and layer 6, which data_parallel='fsdp' would shard as separate units on ranks 0 \\(pp 0, dp 0\\), 1 \\(pp 0, dp 1\\), untying the copies; use data_parallel='replicate'",
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('mesh-batch-split', "a dp rank's batch that does not split into `microbatches` equal parts",
     'inputs of this data-parallel rank have batch size 6, which does not split into microbatches=4 equal parts',
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('mesh-checkpoint', '`save_checkpoint(format="pipedream")` (the default) or `load_checkpoint` of a `format="pipedream"` checkpoint on a pipeline built with `mesh=`',
     "save_checkpoint\\(format='pipedream'\\) does not support pipelines built with mesh= \\(data_parallel='fsdp'\\): each dp rank holds a copy or a shard of its stage; use save_checkpoint\\(\\.\\.\\., format='dcp'\\)",
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('mesh-dp-batch-sizes', 'dp ranks given batches of different sizes (e.g. 8 and 4 rows), on a mesh',
     'step\\(\\)\\ number\\ 0:\\ the\\ data\\-parallel\\ ranks\\ were\\ given\\ batches\\ of\\ different\\ sizes:\\ dp\\ 0\\ \\(rank\\ 0\\ \\(pp\\ 0,\\ dp\\ 0\\)\\)\\ 8\\ rows,\\ dp\\ 1\\ \\(rank\\ 1\\ \\(pp\\ 0,\\ dp\\ 1\\)\\)\\ 4\\ rows;\\ each\\ pipeline\\ averages\\ its\\ own\\ rows\\ \\.\\.\\.\\ give\\ every\\ dp\\ rank\\ the\\ same\\ number\\ of\\ rows\\ \\(the\\ first\\ check_agreement\\ steps,\\ before\\ the\\ step;\\ later\\ steps:\\ step\\(\\)\\ number\\ N\\ ran\\ with\\ batches\\ of\\ different\\ sizes,\\ a\\ RuntimeError\\ when\\ the\\ loss\\ is\\ read\\ or\\ two\\ steps\\ later\\)',
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('mesh-step-skipped', 'a `step()` that raised on some ranks of a mesh, caught and skipped (`except ValueError: continue`) after the first steps',
     'the\\ ranks\\ of\\ the\\ mesh\\ are\\ in\\ different\\ step\\(\\)\\ calls:\\ ranks\\ 0\\ \\(pp\\ 0,\\ dp\\ 0\\),\\ 2\\ \\(pp\\ 1,\\ dp\\ 0\\),\\ 3\\ \\(pp\\ 1,\\ dp\\ 1\\)\\ in\\ step\\(\\)\\ number\\ 1;\\ rank\\ 1\\ \\(pp\\ 0,\\ dp\\ 1\\)\\ in\\ step\\(\\)\\ number\\ 2\\ \\.\\.\\.\\ a\\ step\\(\\)\\ that\\ raises\\ on\\ any\\ rank\\ must\\ end\\ the\\ run,\\ or\\ be\\ caught\\ on\\ every\\ rank\\ alike',
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('mesh-refusal-everywhere', 'an argument the ranks of one pipeline of a mesh disagree on (or any argument refused in the first steps on one pipeline): every rank of every pipeline raises it',
     'rank\\ 0\\ \\(pp\\ 0,\\ dp\\ 0\\):\\ ranks\\ disagree\\ on\\ the\\ pipeline\\ configuration:\\ microbatches\\ is\\ 2\\ on\\ rank\\ 0\\ \\(pp\\ 0,\\ dp\\ 0\\);\\ 4\\ on\\ ranks\\ 1\\ \\(pp\\ 0,\\ dp\\ 1\\),\\ 2\\ \\(pp\\ 1,\\ dp\\ 0\\),\\ 3\\ \\(pp\\ 1,\\ dp\\ 1\\)',
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('mesh-order', "a mesh whose rank order gives no stage order (`DeviceMesh('cpu', [[0, 3], [2, 1]])`)",
     "mesh\\ \\[\\[0,\\ 3\\],\\ \\[2,\\ 1\\]\\]\\ cannot\\ run\\ a\\ pipeline:\\ torch\\ numbers\\ each\\ mesh\\ dimension's\\ ranks\\ by\\ its\\ process\\ group,\\ in\\ ascending\\ order\\ \\(mesh\\['pp'\\]\\.get_local_rank\\(\\)\\),\\ and\\ in\\ the\\ dp\\ group\\ \\[0,\\ 3\\]\\ rank\\ 0\\ is\\ pp\\ rank\\ 0,\\ rank\\ 3\\ is\\ pp\\ rank\\ 1",
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('mesh-auto-few-layers', "`balance='auto'` on a `(4, 1)` mesh with a 3-layer `nn.Sequential`",
     "balance='auto'\\ on\\ a\\ mesh\\ with\\ 4\\ pipeline\\ stages\\ \\(mesh\\['pp'\\]\\)\\ needs\\ at\\ least\\ one\\ layer\\ per\\ stage,\\ but\\ the\\ model\\ has\\ 3\\ layers;\\ use\\ a\\ mesh\\ with\\ at\\ most\\ 3\\ pp\\ ranks",
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('mesh-sampler', 'the first and last stage of one pipeline of a mesh given different batches (a DDP sampler per rank)',
     "stage\\ 0\\ on\\ rank\\ 1\\ \\(pp\\ 0,\\ dp\\ 1\\)\\ and\\ the\\ last\\ stage\\ on\\ rank\\ 3\\ \\(pp\\ 1,\\ dp\\ 1\\)\\ were\\ given\\ different\\ batches\\ \\.\\.\\.\\ use\\ DistributedSampler\\(dataset,\\ num_replicas=2,\\ rank=mesh\\['dp'\\]\\.get_local_rank\\(\\),\\ seed=\\.\\.\\.\\)",
     'tests/test_fsdp.py::test_fsdp_representative_case_and_refusals'),
    ('mesh-stuck-peer', "a rank of a mesh stopped (alive, silent: SIGSTOP) while its dp peer is in FSDP's or the replicas' collectives",
     "rank\\ 2\\ \\(pp\\ 1,\\ dp\\ 0\\):\\ the\\ gradient\\ synchronisation\\ over\\ mesh\\['dp'\\]\\ \\(fsdp,\\ with\\ ranks\\ 2\\ \\(pp\\ 1,\\ dp\\ 0\\),\\ 3\\ \\(pp\\ 1,\\ dp\\ 1\\)\\)\\ in\\ step\\ 21\\ failed\\ or\\ timed\\ out:\\ \\.\\.\\.\\ Timed\\ out\\ \\.\\.\\.\\ lost\\ rank\\ 3:\\ no\\ heartbeat\\ \\(within\\ timeout=,\\ not\\ the\\ process\\ group's\\ 30\\ minutes\\)",
     'tests/test_faults.py::test_sigstop_on_a_mesh_every_other_rank_fails_within_the_timeout'),
    ("plot-path", "`--plot` to a path that cannot be written", r"cannot write the plot ...: directory ... is not writable (exit 2)",
     "tests/test_plot.py::test_cli_plot_bad_path_exits_2_with_a_message"),
]


def model(layers: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*([nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Linear(12, 3)][:layers]))


def _meta_model() -> nn.Sequential:
    with torch.device("meta"):
        return model()


def pipe_kwargs(**kwargs: Any) -> Dict[str, Any]:
    base = dict(loss_fn=F.cross_entropy, schedule="1f1b", microbatches=2, timeout=30)
    base.update(kwargs)
    return base


# -------------------------------------------------------------------------- in-process
IN_PROCESS: Dict[str, Callable[[], Any]] = {
    "not-sequential": lambda: _pd().PipeDream(nn.Linear(2, 2), F.cross_entropy),
    "schedule-name": lambda: _pd().PipeDream(model(), **pipe_kwargs(schedule="1f1c")),
    "microbatches": lambda: _pd().PipeDream(model(), **pipe_kwargs(microbatches=0)),
    "chunks": lambda: _pd().PipeDream(model(), **pipe_kwargs(chunks=2)),
    "v-chunks": lambda: _pd().PipeDream(model(), **pipe_kwargs(schedule="zbv")),
    "vertical-sync": lambda: _pd().PipeDream(model(), **pipe_kwargs(vertical_sync=True)),
    "timeout": lambda: _pd().PipeDream(model(), **pipe_kwargs(timeout=0)),
    "timeout-inf": lambda: _pd().PipeDream(model(), **pipe_kwargs(timeout=float("inf"))),
    "loss-reduction": lambda: _pd().PipeDream(model(), **pipe_kwargs(loss_reduction="max")),
    "tokens-async": lambda: _pd().PipeDream(model(), **pipe_kwargs(schedule="pipedream",
                                                                   loss_reduction="tokens")),
    "tokens-fn-reduction": lambda: _pd().PipeDream(model(), **pipe_kwargs(tokens_fn=len)),
    "balance-string": lambda: _pd().PipeDream(model(), balance="4,4", **pipe_kwargs()),
    "autocast-dtype": lambda: _pd().PipeDream(model(), **pipe_kwargs(autocast=torch.float64)),
    "autocast-async-fp16": lambda: _pd().PipeDream(
        model(), **pipe_kwargs(schedule="pipedream", autocast=torch.float16)),
    "check-finite": lambda: _pd().PipeDream(model(), **pipe_kwargs(check_finite="warn")),
    "recompute-type": lambda: _pd().PipeDream(model(), **pipe_kwargs(recompute=[1, 0])),
    "clip-option-flush": lambda: _pd().PipeDream(model(), **pipe_kwargs(clip_grad_norm=1.0)),
    "clip-option-value": lambda: _pd().PipeDream(model(), **pipe_kwargs(schedule="pipedream",
                                                                        clip_grad_norm=(1.0, 0))),
    "init-seed": lambda: _pd().PipeDream(model(), **pipe_kwargs(init_seed=-1)),
    "meta-auto-balance": lambda: _pd().PipeDream(_meta_model(), balance="auto", **pipe_kwargs()),
    "auto-no-sample": lambda: _pd().PipeDream(model(), **pipe_kwargs(schedule="auto")),
    "auto-split-points": lambda: _pd().PipeDream(_Traceable(), split_points=["b"], **pipe_kwargs(
        microbatches="auto", sample=(torch.randn(4, 6), torch.randint(0, 3, (4,))))),
    "auto-replicas": lambda: _pd().PipeDream(model(), replicas=[1, 1], **pipe_kwargs(
        schedule="auto", sample=(torch.randn(4, 6), torch.randint(0, 3, (4,))))),
    "auto-asynchronous": lambda: _pd().PipeDream(model(), **pipe_kwargs(
        schedule="pipedream", microbatches="auto", sample=(torch.randn(4, 6), torch.randint(0, 3, (4,))))),
    "auto-mesh": lambda: _pd().PipeDream(model(), mesh="auto", **pipe_kwargs()),
    "auto-mesh-split-points": lambda: _pd().PipeDream(_Traceable(), split_points=["b"], mesh="auto",
                                                      **pipe_kwargs(sample=(torch.randn(4, 6),
                                                                            torch.randint(0, 3, (4,))))),
    "auto-mesh-fsdp-options": lambda: _pd().PipeDream(model(), mesh="auto", reshard_after_forward=True,
                                                      **pipe_kwargs()),
    "auto-data-parallel-no-mesh": lambda: _pd().PipeDream(model(), data_parallel="auto",
                                                          **pipe_kwargs()),
    "memory-value": lambda: _pd().PipeDream(model(), **pipe_kwargs(memory=-1)),
    "memory-nothing-searched": lambda: _pd().PipeDream(model(), **pipe_kwargs(memory=8e9)),
    "no-launcher": lambda: _pd().PipeDream(model(), **pipe_kwargs()),
    "module-compile": lambda: _pd().PipeDream(_compiled_in_place(), **pipe_kwargs()),
    "schedule-text": lambda: _pd().schedules.build("1f1b", stages=2, microbatches=2).with_actions(
        "rank 0: 0F0 0Q0\nrank 1: 1F0"),
}


class _Traceable(nn.Module):
    """A model that is not an ``nn.Sequential`` (torch.fx traces it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 12), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _compiled_in_place() -> nn.Sequential:
    compiled = model()
    compiled.compile()
    return compiled


def _pd():
    import pipedream_ext as pd

    return pd


def _message(row_id: str) -> str:
    return next(r[2] for r in ROWS if r[0] == row_id)


@pytest.mark.parametrize("row_id", sorted(IN_PROCESS))
def test_in_process_rows(row_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    with pytest.raises((ValueError, RuntimeError)) as info:
        IN_PROCESS[row_id]()
    assert re.search(_message(row_id), str(info.value)), (row_id, str(info.value))


# -------------------------------------------------------------------------- 2 ranks
def _expect(row_id: str, fn: Callable[[], Any]) -> None:
    with pytest.raises((ValueError, RuntimeError)) as info:
        fn()
    assert re.search(_message(row_id), str(info.value)), (row_id, str(info.value))


# The fused wire format (csrc/runtime/comm_engine.h): int64 words magic, forward,
# boundary, microbatch, redirected, packed bytes, tensor count, then per tensor
# dtype, ndim and its sizes; the payload follows at 64-byte aligned offsets.
MAGIC, FLOAT = 0x50495045, 6  # "PIPE", at::kFloat
GRADIENT_0 = {1: 0, 2: 0, 3: 0}  # the gradient of microbatch 0 across boundary 0


def _header(words: Dict[int, int], size: int = 64) -> torch.Tensor:
    """A ``size``-byte message whose header has the given words (the rest zero)."""
    header = torch.zeros(size // 8, dtype=torch.int64)
    header[0] = MAGIC
    for index, value in words.items():
        header[index] = value
    return header.view(torch.uint8)


def _redirected(full: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The 64-byte message the receiver posted for a slot it has not seen (a header
    redirecting to the side channel) and ``full``, the packed message that follows there."""
    return _header({**GRADIENT_0, 4: 1, 5: full.numel()}), full


def _gradient(shape: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """A well-formed gradient transfer of ``shape``, redirected (see :func:`_redirected`)."""
    payload = torch.zeros(shape)
    packed = 128 + -(-payload.numel() * 4 // 64) * 64
    words = {**GRADIENT_0, 5: packed, 6: 1, 7: FLOAT, 8: 2, 9: shape[0], 10: shape[1]}
    full = _header(words, packed)
    full[128:128 + payload.numel() * 4] = payload.view(-1).view(torch.uint8)
    return _redirected(full)


# Rows refused at construction on 2 ranks (world size, replicas, a config that differs
# between the ranks, a plan file), each its own case.
WORLD_ROWS = ("balance-count", "balance-sum", "balance-empty", "world-size", "replicas-zero",
              "too-few-layers", "config-mismatch", "plan-file", "recompute-stages", "recompute-rank",
              "auto-mesh-factorisation")


def check_world_row(row_id: str) -> None:
    import pipedream_ext as pd

    if row_id == "plan-file":
        bad = os.path.join(os.environ["BAD_INPUT_DIR"], f"notaplan{dist.get_rank()}.json")
        with open(bad, "w") as f:
            f.write('{"stages": "many"}')
        _expect(row_id, lambda: pd.PipeDream(model(), balance=bad, **pipe_kwargs()))
        return
    mb = 2 if dist.get_rank() == 0 else 4
    build = {
        "balance-count": lambda: pd.PipeDream(model(), balance=[1, 1, 2], **pipe_kwargs()),
        "balance-sum": lambda: pd.PipeDream(model(), balance=[2, 9], **pipe_kwargs()),
        "balance-empty": lambda: pd.PipeDream(model(), balance=[0, 4], **pipe_kwargs()),
        "world-size": lambda: pd.PipeDream(model(), replicas=[2, 1], **pipe_kwargs()),
        "replicas-zero": lambda: pd.PipeDream(model(), replicas=[0, 2], **pipe_kwargs()),
        "too-few-layers": lambda: pd.PipeDream(model(1), **pipe_kwargs()),
        "config-mismatch": lambda: pd.PipeDream(model(), **pipe_kwargs(microbatches=mb)),
        "recompute-stages": lambda: pd.PipeDream(model(), **pipe_kwargs(recompute=[True, False, True])),
        "recompute-rank": lambda: pd.PipeDream(model(), **pipe_kwargs(
            schedule="zbv", chunks=2, recompute=[True, True, False, False])),
        # 1 layer: pp 1, so dp 2, which does not divide 3 rows (refused before the search)
        "auto-mesh-factorisation": lambda: pd.PipeDream(model(1), mesh="auto", **pipe_kwargs(
            sample=(torch.randn(3, 6), torch.randint(0, 3, (3,))))),
    }[row_id]
    _expect(row_id, build)


def check_optimizer_row() -> None:
    """An optimizer over the whole model holds the other rank's layers: refused at its
    first step on every rank (no communication), before it could skip them silently."""
    import pipedream_ext as pd

    whole = model()
    opt = torch.optim.AdamW(whole.parameters(), lr=0.1)
    pipe = pd.PipeDream(whole, **pipe_kwargs(timeout=60))
    pipe.step(torch.randn(8, 6), torch.randint(0, 3, (8,)))
    _expect("optimizer-before-pipeline", opt.step)


def check_loss_shape_row() -> None:
    """A bad loss is found on the last rank only; the step still ends (a zero loss) and
    every rank raises the same error at its end, within seconds, naming the rank."""
    import pipedream_ext as pd

    pipe = pd.PipeDream(model(), **pipe_kwargs(
        timeout=60, loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none")))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    with pytest.raises(ValueError, match=r"step\(\) number 0 failed on rank 1: ") as info:
        pipe.step(x, y)
    assert re.search(_message("loss-shape"), str(info.value)), str(info.value)


def hostile_messages() -> Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """Per row, the message on the pipeline's group and the one on the side group or None."""
    return dict([
        ("peer-magic", (_header({0: 12345}), None)),
        ("peer-count", (_header({**GRADIENT_0, 6: 99}), None)),
        ("peer-negative-size", _redirected(_header({**GRADIENT_0, 5: 128, 6: 1, 7: FLOAT, 8: 2, 9: 2,
                                                    10: -3}, 128))),
        ("peer-dtype", _redirected(_header({**GRADIENT_0, 5: 128, 6: 1, 7: 999, 8: 2, 9: 2, 10: 12},
                                           128))),
        ("peer-order", (_header({1: 1, 2: 0, 3: 0, 5: 64}), None)),  # an activation, not the gradient
        ("peer-gradient-shape", _gradient((2, 99))),
    ])


HOSTILE_ROWS = ("peer-magic", "peer-count", "peer-negative-size", "peer-dtype", "peer-order",
                "peer-gradient-shape")


def check_hostile_peer_row(row_id: str) -> None:
    """Rank 1 builds the pipeline, then plays stage 1 by hand with a malformed header."""
    import pipedream_ext as pd
    import pipedream_ext._dist.groups as _groups

    message, side_message = hostile_messages()[row_id]
    # No agreement exchange: rank 1 is not running the pipeline.
    pipe = pd.PipeDream(model(), **pipe_kwargs(microbatches=1, timeout=20, check_agreement=0))
    x, _ = torch.randn(2, 6), torch.randint(0, 3, (2,))
    if dist.get_rank() == 0:
        _expect(row_id, lambda: pipe.step(x, None))
    else:
        # Take stage 0's activation (the first of a slot: a 64-byte header on the
        # pipeline's group, the packed message on the side group) so nothing is left
        # pending, then answer with the malformed gradient.
        side = _groups.side_group([0, 1])
        got = torch.zeros(64, dtype=torch.uint8)
        dist.recv(got, src=0)
        packed = int(got.view(torch.int64)[5])
        dist.recv(torch.zeros(packed, dtype=torch.uint8), src=0, group=side)
        dist.send(message, dst=0)
        if side_message is not None:
            dist.send(side_message, dst=0, group=side)
    dist.barrier()


def two_rank_cases(world: int) -> Cases:
    cases = Cases()
    for row_id in WORLD_ROWS:
        cases.add(check_world_row, row_id, name=row_id)
    for row_id in HOSTILE_ROWS:
        cases.add(check_hostile_peer_row, row_id, name=row_id)
    cases.add(check_optimizer_row, name="optimizer-before-pipeline")
    cases.add(check_loss_shape_row, name="loss-shape")
    return cases


TWO_RANKS = Launch(os.path.abspath(__file__), 2, two_rank_cases, timeout=300, dirs=("BAD_INPUT_DIR",))


@parametrize_cases(TWO_RANKS)
def test_two_rank_rows(case: CaseRef) -> None:
    case.check()


# -------------------------------------------------------------------------- the table
def test_every_row_is_tested_here_or_names_an_existing_test() -> None:
    here = set(IN_PROCESS) | {"balance-count", "balance-sum", "balance-empty", "world-size",
                              "replicas-zero", "too-few-layers", "config-mismatch", "plan-file",
                              "recompute-stages", "recompute-rank", "auto-mesh-factorisation",
                              "optimizer-before-pipeline", "loss-shape", "peer-magic", "peer-count",
                              "peer-negative-size", "peer-dtype", "peer-order", "peer-gradient-shape"}
    for row_id, _what, _message_re, where in ROWS:
        if where == "here":
            assert row_id in here, f"row {row_id} says it is tested here but is not"
            continue
        path, _, name = where.partition("::")
        with open(os.path.join(ROOT, path)) as f:
            assert re.search(rf"def {re.escape(name)}\(", f.read()), f"{where} does not exist"


def test_docs_table_lists_every_row() -> None:
    with open(DOC) as f:
        text = f.read()
    for row_id, what, _message, where in ROWS:
        assert f"| `{row_id}` | {what} |" in text, f"docs/bad_input.md lacks row {row_id}"
        assert (where if where != "here" else "tests/test_bad_input.py (here)") in text, \
            f"docs/bad_input.md does not name the test of {row_id}"


if __name__ == "__main__":
    worker_main([TWO_RANKS])
