"""Gemma 2 (Gemma2ForCausalLM) and Gemma 3's text model (Gemma3ForCausalLM) against transformers' classes
on tiny random-weight models, with sliding windows far shorter than the prompts.

Each model is written by transformers (seeded, float32, eager attention, `save_pretrained` beside the
bundled tokenizer) with every weight drawn at random, Gemma's norm weights (scale 1 + w) included, so
a norm read without its offset changes the logits. Gemma 2: local and global layers alternating with
a 12-token window, soft-caps of 5 (attention) and 3 (final logits) that the random weights push well
into the tanh's bend, query_pre_attn_scalar 24 (not head_dim). Gemma 3: two local layers (window 12,
rope base 10,000) to one global (rope base 1,000,000 with linear scaling x 2), q/k norms.

Shown for each: greedy 32-token continuations of 8 prompts (5 to 130 tokens) equal HF `generate`, alone
and in a batch with chunked prefill, a preemption and a warm prefix cache, on the C kernels, on SDPA
with the eager ops, over two tensor-parallel ranks (gloo), and (fewer prompts, under the Triton
interpreter) on the Triton kernels, and with the model drafting for itself (speculative verification);
beam search's best beam and score equal HF's `generate(num_beams=4)`; prompt log-probabilities within
1e-4 of HF's float32 log-softmax; a GGUF written by the `gguf` package equals its safetensors twin.
"""

from __future__ import annotations

import json

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.kv.capacity import weight_bytes
from batchgen.engine.models.config import ModelConfig
from batchgen.kernels import cpu_elementwise, cpu_paged_attention
from tests.engine.helpers import hf_greedy, run_requests
from tests.engine.models.test_registry import randomize_weights

WINDOW = 12
NUM_TOKENS = 32
NUM_BLOCKS = 24  # 384 tokens of KV: less than the batch needs at once, so the scheduler preempts
ENGINE = dict(dtype="float32", device="cpu", max_model_len=NUM_BLOCKS * 16, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-6, query_pre_attn_scalar=24, sliding_window=WINDOW,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
FAMILIES = {
    "Gemma2ForCausalLM": dict(num_hidden_layers=2, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "Gemma3ForCausalLM": dict(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention",
                                                                "full_attention"],
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 1000000.0}}),
}


def hf_config(architecture: str, vocab_size: int, **keys):
    import transformers

    name = "Gemma2Config" if architecture.startswith("Gemma2") else "Gemma3TextConfig"
    config = getattr(transformers, name)(vocab_size=vocab_size, **{**SHAPE, **FAMILIES[architecture], **keys})
    config._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module", params=list(FAMILIES))
def gemma(request, hf_tokenizer, tmp_path_factory):
    """(architecture, HF model, its saved folder)."""
    import transformers

    architecture = request.param
    torch.manual_seed(0)
    hf = randomize_weights(getattr(transformers, architecture)(hf_config(architecture, len(hf_tokenizer))))
    with torch.no_grad():  # Gemma's norm weights are offsets from 1: draw them around 0, off their init
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    hf = hf.float().eval()
    folder = tmp_path_factory.mktemp(architecture)
    hf.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return architecture, hf, folder


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> list[list[int]]:
    """Eight prompts of 5 to 130 tokens (most longer than the window); three share a 48-token prefix."""
    gen = torch.Generator().manual_seed(1)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, len(hf_tokenizer), (n,), generator=gen).tolist()

    prefix = tokens(48)
    return [tokens(5), tokens(16), tokens(17), prefix + tokens(3), prefix + tokens(30), tokens(70),
            prefix + tokens(60), tokens(130)]


@pytest.fixture(scope="module")
def hf_tokens(gemma, prompts) -> list[list[int]]:
    _, hf, _ = gemma
    return hf_greedy(hf, prompts, NUM_TOKENS, eos_token_ids=(2,), pad_token_id=0)


def greedy_batch(llm: LLM, prompts: list[list[int]], tag: str) -> dict[str, object]:
    return run_requests(llm.engine, {f"{tag}-{i}": (ids, GREEDY) for i, ids in enumerate(prompts)})


def assert_tokens(outputs: dict, tag: str, hf_tokens: list[list[int]], indices) -> None:
    for i in indices:
        assert outputs[f"{tag}-{i}"].outputs[0].token_ids == hf_tokens[i], f"{tag} prompt {i}"


def test_the_config_turns_gemmas_differences_on(gemma):
    architecture, _, folder = gemma
    cfg = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    assert (cfg.architecture, cfg.sandwich_norms, cfg.hidden_act, cfg.attention_scale) == (
        architecture, True, "gelu_pytorch_tanh", 24 ** -0.5)
    windows = [cfg.layer_sliding_window(i) for i in range(cfg.num_layers)]
    if architecture == "Gemma2ForCausalLM":
        assert windows == [WINDOW, None]
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.qk_norm) == (5.0, 3.0, False)
    else:
        assert windows == [WINDOW, WINDOW, None]
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.qk_norm) == (None, None, True)
        assert (cfg.rope_local_theta, cfg.rope_theta, cfg.rope_scaling["factor"]) == (10000.0, 1e6, 2.0)
    # transformers' defaults where config.json says nothing: tied embeddings; Gemma 2 alternates from
    # layer 0 with softcaps 50 / 30; Gemma 3 has five local layers to one global.
    bare = {"architectures": [architecture], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_hidden_layers": 6}
    default = ModelConfig.from_hf_dict(bare)
    assert default.tie_word_embeddings and default.sliding_window == 4096 and default.query_pre_attn_scalar == 256
    if architecture == "Gemma2ForCausalLM":
        assert default.layer_types == ("sliding_attention", "full_attention") * 3
        assert (default.attn_logit_softcapping, default.final_logit_softcapping) == (50.0, 30.0)
    else:
        assert default.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
        old = ModelConfig.from_hf_dict({**bare, "sliding_window_pattern": 3, "rope_theta": 5e5,
                                        "rope_local_base_freq": 2e4, "rope_scaling": {"rope_type": "linear",
                                                                                      "factor": 8.0}})
        assert old.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
        assert (old.rope_theta, old.rope_local_theta, old.rope_scaling["factor"]) == (5e5, 2e4, 8.0)


@torch.no_grad()
def test_the_window_and_the_soft_caps_engage_in_this_model(gemma, prompts):
    """HF's own class gives other logits without its window (and, Gemma 2, without each soft-cap): the
    prompts are long enough and the scores large enough for every one of them to matter."""
    architecture, hf, _ = gemma
    ids = torch.tensor([prompts[5]])
    reference = hf(ids).logits
    hf.config.sliding_window = 4096
    try:
        assert (hf(ids).logits - reference).abs().max() > 0.05
    finally:
        hf.config.sliding_window = WINDOW
    if architecture != "Gemma2ForCausalLM":
        return
    assert reference.abs().max() < 3.0
    attentions = [layer.self_attn for layer in hf.model.layers]
    hf.config.final_logit_softcapping = None
    try:
        assert hf(ids).logits.abs().max() > 6.0  # final logits well past the cap of 3
        for attention in attentions:
            attention.attn_logit_softcapping = None
        uncapped_attention = hf(ids).logits
    finally:
        hf.config.final_logit_softcapping = 3.0
        for attention in attentions:
            attention.attn_logit_softcapping = 5.0
    assert (torch.tanh(uncapped_attention / 3.0) * 3.0 - reference).abs().max() > 0.05  # the attention cap bends


@torch.no_grad()
def test_greedy_equals_hf_alone_batched_chunked_preempted_and_prefix_cached(gemma, prompts, hf_tokens):
    _, _, folder = gemma
    llm = LLM(str(folder), num_kv_blocks=NUM_BLOCKS, **ENGINE)
    engine = llm.engine
    assert engine.capabilities.attention_backend == "cpu" and engine.capabilities.elementwise_ops == "c"
    assert engine.weight_bytes == weight_bytes(engine.model_cfg, torch.float32)  # the four norms per layer
    for i in (0, 7):  # alone
        out = greedy_batch(llm, [prompts[i]], f"alone{i}")[f"alone{i}-0"]
        assert out.outputs[0].token_ids == hf_tokens[i], f"prompt {i} alone"
    for run in ("cold", "warm"):  # the second run finds the prompts' blocks in the prefix cache
        before = dict(engine.stats)
        outputs = greedy_batch(llm, prompts, run)
        assert_tokens(outputs, run, hf_tokens, range(len(prompts)))
        stats = engine.stats
        assert stats["num_partial_prefills"] > before["num_partial_prefills"]
        if run == "cold":
            assert stats["num_preemptions"] > before["num_preemptions"]
    # The local layers' blocks of a shared prefix go back once its sequences move past the window, so under
    # this pool's pressure one of the three may be reused before the warm run (test_windowed_kv.py shows all
    # three hits in a pool with room).
    assert sum(outputs[f"warm-{i}"].num_cached_tokens for i in range(len(prompts))) >= 2 * 48


@torch.no_grad()
def test_local_layers_hold_only_their_window_and_outputs_stay_hfs(gemma, prompts, hf_tokens):
    """The sliding-window layers' own block group (kv/window_groups.py): with 4-token blocks and a 12-token
    window, a decoding sequence holds at most 12 / 4 + 1 = 4 local blocks (prompts up to 130 tokens, > 10x
    the window) while its global blocks cover every token; their caches are the smaller pool; tokens equal
    HF's, batched and chunked; and a later request reuses a shared prefix (its global blocks and the local
    ones inside the window at the hit); and with steps launched ahead."""
    architecture, _, folder = gemma
    block_size, num_full_blocks, max_num_seqs = 4, 200, 8
    llm = LLM(str(folder), num_kv_blocks=num_full_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
              **ENGINE)
    engine = llm.engine
    manager, runner = engine.kv_cache_manager, engine.runner
    windowed = manager.windowed
    local_layers = {0} if architecture == "Gemma2ForCausalLM" else {0, 1}
    assert windowed is not None and windowed.local_layers == local_layers and windowed.window == WINDOW
    # The split: the local pool holds every running sequence's window plus a step's chunk; its bytes left
    # over go to the global layers (two or one local layers per global one).
    num_local = max_num_seqs * (WINDOW // block_size + 1) + 32 // block_size + 1
    num_global = num_full_blocks + (num_full_blocks - num_local) * len(local_layers)
    assert (windowed.num_local_blocks, windowed.num_blocks, manager.pool.num_blocks) == (num_local, num_global,
                                                                                       num_global)
    slots = [cache.k.shape[0] for cache in runner.kv_caches]
    assert slots == [(num_local if i in local_layers else num_global) * block_size for i in range(len(slots))]
    assert sum(slots) <= num_full_blocks * block_size * len(slots)  # no more bytes than one group would take

    for i, ids in enumerate(prompts):
        engine.add_request(f"held-{i}", ids, GREEDY)
    max_window_blocks = WINDOW // block_size + 1
    outputs, max_held = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        for seq in engine.scheduler.running:
            num_held = len(seq.local_block_ids) - seq.num_local_freed
            assert len(seq.block_ids) == len(seq.local_block_ids) == -(-seq.num_computed_tokens // block_size)
            if seq.num_computed_tokens > seq.num_prompt_tokens:  # decoding: one query a step
                assert num_held <= max_window_blocks, (seq.request_id, seq.num_computed_tokens, num_held)
                max_held = max(max_held, num_held)
    assert max_held == max_window_blocks
    assert_tokens(outputs, "held", hf_tokens, range(len(prompts)))
    assert manager.local_pool.num_free_blocks == num_local  # every local block went back
    report = engine.stats["kv_cache"]
    assert (report["sliding_window_layers"], report["num_local_blocks"], engine.stats["num_blocks"]) == (
        len(local_layers), num_local, num_global)

    # prompts 4 and 6 share a 48-token prefix: the second finds its 12 blocks (the local ones at positions
    # 37..47, inside the window of its first computed token, still cached)
    first = greedy_batch(llm, [prompts[4]], "first")["first-0"]
    second = greedy_batch(llm, [prompts[6]], "second")["second-0"]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 48)
    assert second.outputs[0].token_ids == hf_tokens[6]

    # Steps launched one ahead (async scheduling): blocks are freed while the step before is in flight.
    ahead = LLM(str(folder), num_kv_blocks=num_full_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                async_scheduling=True, **ENGINE)
    assert ahead.engine.config.is_async_scheduling and ahead.engine.kv_cache_manager.windowed is not None
    assert_tokens(greedy_batch(ahead, prompts, "ahead"), "ahead", hf_tokens, range(len(prompts)))


@torch.no_grad()
def test_sdpa_with_eager_ops_equals_hf(gemma, prompts, hf_tokens, monkeypatch):
    _, _, folder = gemma
    monkeypatch.setattr(cpu_paged_attention, "is_available", lambda: False)
    monkeypatch.setattr(cpu_elementwise, "is_available", lambda: False)
    llm = LLM(str(folder), num_kv_blocks=NUM_BLOCKS, **ENGINE)
    capabilities = llm.engine.capabilities
    assert capabilities.attention_backend == "sdpa" and capabilities.elementwise_ops == "eager"
    for run in ("cold", "warm"):  # staged decodes, fresh prompts, chunks over cached prefixes
        assert_tokens(greedy_batch(llm, prompts, run), run, hf_tokens, range(len(prompts)))


@pytest.mark.triton
@torch.no_grad()
def test_triton_kernels_equal_hf(gemma, prompts, hf_tokens):
    """Under the interpreter (8 tokens, to keep it cheap): a 17-token prompt prefilled in chunks beside
    a 70-token one's, then both decoding through decode graphs (the eager stand-in capture), whose static
    buffers hold the local layers' slots and block tables beside the full ones."""
    from batchgen.engine.runner.decode_graphs import EagerCapturer

    _, _, folder = gemma
    llm = LLM(str(folder), num_kv_blocks=NUM_BLOCKS, attention_backend="triton", max_num_seqs=2,
              **{**ENGINE, "max_num_batched_tokens": 16})
    assert llm.engine.capabilities.attention_backend == "triton" and llm.engine.kv_cache_manager.windowed
    capturer = EagerCapturer()
    llm.engine.runner.capture_decode_graphs(ENGINE["max_model_len"], capturer=capturer)
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = run_requests(llm.engine, {i: (prompts[i], params) for i in (2, 5)})
    for i in (2, 5):
        assert outputs[i].outputs[0].token_ids == hf_tokens[i][:8], f"prompt {i}"
    assert capturer.num_replays > 0 and llm.engine.runner.graphs.local_block_tables is not None


@torch.no_grad()
def test_prompt_logprobs_are_hfs_log_softmax(gemma, prompts):
    _, hf, folder = gemma
    llm = LLM(str(folder), num_kv_blocks=NUM_BLOCKS, **ENGINE)  # 32-token chunks: split prefills
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = run_requests(llm.engine, {f"lp-{i}": (prompts[i], params) for i in (4, 7)})
    for i in (4, 7):
        ids = prompts[i]
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        expected = expected.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        positions = outputs[f"lp-{i}"].prompt_logprobs
        ours = torch.tensor([position[t].logprob for position, t in zip(positions[1:], ids[1:])])
        assert (ours - expected).abs().max().item() <= 1e-4, f"prompt {i}"


@pytest.mark.subprocess
@torch.no_grad()
def test_two_ranks_over_gloo_equal_hf(gemma, prompts, hf_tokens):
    """Tensor parallelism: each rank holds half the query heads, one of the two KV heads and half the MLP
    (Gemma 3's per-head q/k norms whole), its backend the model's windows, soft-cap and scale, its local
    layers' block group; the final soft-cap is applied once to the whole logits. Tokens equal HF's,
    batched, chunked, preempted."""
    _, _, folder = gemma
    threads = torch.get_num_threads()
    llm = LLM(str(folder), num_kv_blocks=14, tensor_parallel_size=2, max_num_seqs=4,
              **{**ENGINE, "max_model_len": 14 * 16})
    try:
        model = llm.engine.runner.model
        assert model.layers[0].self_attn.qkv_proj.weight.shape == (2 * 16 + 2 * 16, 64)  # 2 query heads, 1 KV head
        assert model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 64, 64)
        assert model.backend.scale == 24 ** -0.5
        cfg = llm.engine.model_cfg
        assert [layer.sliding_window for layer in model.backend.layers] == [
            cfg.layer_sliding_window(i) for i in range(cfg.num_layers)]
        assert WINDOW in [layer.sliding_window for layer in model.backend.layers]
        # the window layers' own block group on every rank: the workers unpack its slots and tables
        # (4 sequences at most: a local pool of 4 x 2 + 32 / 16 + 1 = 11 blocks, the global one 14 + 3 x
        # local / global layers: tight enough to preempt)
        windowed = llm.engine.kv_cache_manager.windowed
        assert windowed.num_local_blocks == 11 < windowed.num_blocks and llm.engine.runner.windowed == windowed
        outputs = greedy_batch(llm, prompts, "tp")
        assert_tokens(outputs, "tp", hf_tokens, range(len(prompts)))
        assert llm.engine.stats["num_preemptions"] > 0 and llm.engine.stats["num_partial_prefills"] > 0
    finally:
        llm.engine.shutdown()
        torch.set_num_threads(threads)


def write_gemma_gguf(hf, path):
    """The tiny model as llama.cpp's converter writes a Gemma 2 / Gemma 3 (convert_hf_to_gguf.py's
    Gemma2Model / Gemma3Model): key_length = head_dim, every norm weight stored as 1 + w, Gemma 2's window
    and soft-caps, Gemma 3's window, its local/global period (sliding_window_pattern), both rope bases and
    the global linear scaling; a small tokenizer (small_gguf_tokenizer.py) with the model's vocabulary size.
    The untied lm_head is written as `output` (llama.cpp's own Gemma 2 files tie it)."""
    import gguf

    from tests.engine.models.gguf_writing import finish_gguf, new_gguf_writer
    from tests.engine.models.small_gguf_tokenizer import add_small_tokenizer

    cfg = hf.config
    arch = "gemma2" if cfg.model_type == "gemma2" else "gemma3"
    writer = new_gguf_writer(path, arch, cfg)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        rope = cfg.rope_parameters
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
        writer.add_sliding_window_pattern(cfg.layer_types.index("full_attention") + 1)
    add_small_tokenizer(writer, cfg.vocab_size)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
             "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, tensor in hf.state_dict().items():
        name = name.removeprefix("model.").removesuffix(".weight")
        if name == "lm_head":
            gguf_name = "output"
        elif name.startswith("layers."):
            _, layer, rest = name.split(".", 2)
            gguf_name = f"blk.{layer}.{names[rest]}"
        else:
            gguf_name = names[name]
        array = tensor.float().numpy()
        if name.endswith("norm"):
            array = array + 1.0  # the converter's Gemma norms: 1 + w
        writer.add_tensor(f"{gguf_name}.weight", array)
    finish_gguf(writer)
    return path


@torch.no_grad()
def test_a_gguf_written_by_the_gguf_package_matches_its_safetensors_twin(gemma, prompts, tmp_path):
    """llama.cpp's Gemma files carry no query_pre_attn_scalar (its rule: head_dim but for the 27B layer
    counts), so the twin is the same weights with query_pre_attn_scalar = head_dim. The GGUF's config is
    the twin's, field by field, and every sampled row's logits and token equal the twin's."""
    from batchgen.engine.loader.gguf_loader import read_gguf_config
    from tests.engine.helpers import captured_logits, relative_error

    architecture, hf, folder = gemma
    twin = tmp_path / "twin"
    twin.mkdir()
    for file in folder.iterdir():
        if file.name != "config.json":
            (twin / file.name).symlink_to(file)
    config = json.loads((folder / "config.json").read_text())
    (twin / "config.json").write_text(json.dumps({**config, "query_pre_attn_scalar": config["head_dim"]}))
    path = write_gemma_gguf(hf, tmp_path / "gemma.gguf")

    gguf_cfg = read_gguf_config(path)
    twin_cfg = ModelConfig.from_hf_dict(json.loads((twin / "config.json").read_text()))
    for key in ("architecture", "sandwich_norms", "hidden_act", "qk_norm", "tie_word_embeddings", "sliding_window",
                "layer_types", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                "rope_theta", "rope_local_theta", "head_dim", "num_kv_heads"):
        assert getattr(gguf_cfg, key) == getattr(twin_cfg, key), key
    assert (gguf_cfg.rope_scaling or {}).get("factor") == (twin_cfg.rope_scaling or {}).get("factor")

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = {i: (prompts[i], params) for i in (2, 5, 7)}
    results = []
    for source in (twin, path):
        llm = LLM(str(source), num_kv_blocks=NUM_BLOCKS, **ENGINE)
        with captured_logits(llm.engine) as records:
            outputs = run_requests(llm.engine, requests)
        results.append(({i: outputs[i].outputs[0].token_ids for i in requests}, records))
    (twin_tokens, twin_logits), (gguf_tokens, gguf_logits) = results
    assert gguf_tokens == twin_tokens
    for key, logits in twin_logits.items():
        assert relative_error(gguf_logits[key], logits) <= 1e-5, key


@torch.no_grad()
def test_speculative_verification_keeps_hfs_tokens(gemma, prompts, hf_tokens):
    """The model drafting for itself (4 tokens a step): every verify step attends 5 queries a sequence
    through the windows (and Gemma 2's caps) of both the draft and the target; tokens equal HF's."""
    _, _, folder = gemma
    llm = LLM(str(folder), num_kv_blocks=4 * NUM_BLOCKS, max_num_seqs=8,
              speculative={"method": "draft_model", "model": str(folder), "disable_by_batch_size": 8}, **ENGINE)
    outputs = greedy_batch(llm, prompts, "spec")
    assert_tokens(outputs, "spec", hf_tokens, range(len(prompts)))
    assert llm.engine.spec.stats.num_accepted_tokens > 0


@torch.no_grad()
def test_beam_search_equals_hf_generate_num_beams(gemma, prompts):
    """Beams forking shared blocks attend through the windows: the best beam and its score equal HF's
    `generate(num_beams=4)` on prompts longer than the window."""
    _, hf, folder = gemma
    width, num_tokens = 4, 12
    llm = LLM(str(folder), num_kv_blocks=4 * NUM_BLOCKS, **ENGINE)
    params = SamplingParams(beam_width=width, n=width, temperature=0, max_tokens=num_tokens, logprobs=0)
    outputs = run_requests(llm.engine, {i: (prompts[i], params) for i in (4, 5)})
    for i in (4, 5):
        out = hf.generate(torch.tensor([prompts[i]]), num_beams=width, do_sample=False, length_penalty=1.0,
                          max_new_tokens=num_tokens, eos_token_id=2, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompts[i]):].tolist()
        tokens = tokens[:tokens.index(2) + 1] if 2 in tokens else tokens
        best = outputs[i].outputs[0]
        assert best.token_ids == tokens, f"prompt {i}"
        assert abs(best.score - out.sequences_scores[0].item()) <= 1e-4, f"prompt {i}"


@pytest.mark.parametrize("arch, num_layers, pattern, expected_types, expected_scalar", [
    ("gemma3", 6, [True, False, True, True, True, False], "LFLLLF", 32),  # one bool a layer
    ("gemma3", 62, None, ("LLLLLF" * 11)[:62], 640 // 4),  # llama.cpp: period 6; the 27B's layer count
    ("gemma2", 4, None, "LFLF", 32),  # period 2, head_dim's scale
    ("gemma2", 46, 0, "L" * 46, 640 // 4),  # period 0: every layer local; the 27B's layer count
])
def test_gguf_gemma_metadata_as_llama_cpp_reads_it(tmp_path, arch, num_layers, pattern, expected_types,
                                                   expected_scalar):
    """Header-only GGUF files: the local/global layers from sliding_window_pattern (absent, a period or
    one bool a layer) and the query scale by llama.cpp's layer-count rule (hidden / heads for the 27B
    checkpoints, else head_dim); Gemma 2's soft-caps default to 50 / 30 when absent."""
    import gguf
    import numpy as np

    from batchgen.engine.loader.gguf_loader import read_gguf_config
    from tests.engine.models.gguf_writing import finish_gguf

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(num_layers)
    writer.add_embedding_length(640)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(32)
    writer.add_value_length(32)
    writer.add_sliding_window(512)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor("token_embd.weight", np.zeros((3, 640), dtype=np.float32))
    finish_gguf(writer)
    cfg = read_gguf_config(path)
    kinds = {"L": "sliding_attention", "F": "full_attention"}
    assert cfg.layer_types == tuple(kinds[c] for c in expected_types)
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.head_dim) == (512, expected_scalar, 32)
    assert cfg.architecture == ("Gemma2ForCausalLM" if arch == "gemma2" else "Gemma3ForCausalLM")
    if arch == "gemma2":
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    else:
        assert (cfg.attn_logit_softcapping, cfg.rope_local_theta) == (None, 10000.0)
