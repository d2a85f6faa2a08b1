"""Vocabulary pieces (models/pieces.py): the embedding and the head cut into row ranges so
that slots and buffers are sized by a block.

Exactness: the embedding's forward and backward and each piece's logits are bit-identical
to the whole matrices'; the cross-entropy (online log-sum-exp) and the head's input
gradient (summed over pieces) differ by rounding. Stated tolerances, measured here: with
SGD (no normalisation of the update) the final weights differ from plain PyTorch's by at
most 1e-5 of how far they moved (measured 1.6e-7 .. 2.9e-7) and the losses by 1e-6
relative (measured 0.9e-7 .. 1.8e-7); AdamW divides each gradient by its own magnitude,
which turns rounding in near-zero gradients into differences of up to a step's size in
those elements: losses within 1e-5 relative, weights within 2e-4 absolute (lr 2e-3;
measured 4e-5)."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from reference import reference_model, reference_train, small_config, weights_of

from tiertrain.checkpoint.export import export_checkpoint
from tiertrain.config import ConfigError
from tiertrain.cost import step_traffic
from tiertrain.models import _hf_names, auto_pieces, build_model, tensor_source
from tiertrain.models.pieces import EmbedPiece, rows_per_piece
from tiertrain.training.trainer import Trainer


def _train_cut(cfg, init, pieces):
    cfg.model.vocab_pieces = pieces
    skeleton, _ = build_model(cfg.model, param_dtype=torch.float32, seed=0)
    with Trainer(cfg, weights=tensor_source(skeleton, init)) as tr:
        tr.initialize(progress=False)
        losses = [tr.train_step().extra["losses"] for _ in range(cfg.train.steps)]
        names = _hf_names(tr.model) if tr.model.hf_model is not None else None
        return losses, tr.weights(), names, tr


def _rel(a, b):
    return max(abs(x - y) / abs(y) for la, lb in zip(a, b) for x, y in zip(la, lb))


@pytest.mark.parametrize("kind,tie,micro_batches", [("gpt", False, 3), ("llama", False, 2), ("gpt2", True, 2)])
def test_cut_model_trains_as_plain_pytorch_within_rounding_sgd(tmp_path, kind, tie, micro_batches):
    cfg = small_config(tmp_path, kind=kind, tie=tie, micro_batches=micro_batches, lr=0.5)
    cfg.optim.name, cfg.optim.momentum = "sgd", 0.9
    ref = reference_model(cfg)
    init = weights_of(ref)
    ref_losses, ref_w = reference_train(cfg, ref)
    losses, w, names, tr = _train_cut(cfg, init, 3)
    assert len(tr.model.head_pieces) == 3  # units of their own, a third of the matrix each
    assert all(
        tr.layout.units[r.index].used == 86 * 64 or tr.layout.units[r.index].used in (84 * 64, 0)
        for r in tr.model.plan
        if r.role.endswith("piece")
    )
    assert _rel(losses, ref_losses) < 1e-6
    for n, t in w.items():  # whole matrices, by their names in the uncut model
        theirs = ref_w[names[n] if names else n]
        moved = (theirs - init[names[n] if names else n]).norm()
        assert (t - theirs).norm() <= 1e-5 * moved + 1e-12, n


def test_cut_model_adamw_within_stated_tolerance(tmp_path):
    cfg = small_config(tmp_path, micro_batches=2)
    ref = reference_model(cfg)
    ref_losses, ref_w = reference_train(cfg, ref)
    losses, w, _, _ = _train_cut(cfg, weights_of(ref), 4)
    assert _rel(losses, ref_losses) < 1e-5
    for n, t in w.items():
        torch.testing.assert_close(t, ref_w[n], atol=2e-4, rtol=0, msg=n)


def test_embedding_pieces_are_exact_forward_and_backward():
    torch.manual_seed(0)
    vocab, d, rows = 1000, 48, 300
    w = torch.randn(vocab, d, requires_grad=True)
    ids = torch.randint(0, vocab, (4, 256))
    ids[:, ::3] = 7  # repeated tokens: their gradients add in token order
    dout = torch.randn(4, 256, d)
    whole = F.embedding(ids, w)
    whole.backward(dout)
    out, grad = torch.empty(4, 256, d), torch.zeros(vocab, d)
    for start in range(0, vocab, rows):
        p = EmbedPiece(start, min(rows, vocab - start), d, None)
        p.weight = torch.nn.Parameter(w.detach()[start : start + p.num_embeddings])
        p.gather_into(out, ids)
        p.add_grad(grad[start : start + p.num_embeddings], ids, dout)
    assert torch.equal(out, whole.detach()) and torch.equal(grad, w.grad)


def test_pieces_are_sized_by_a_block_and_only_used_rows_are_read(tmp_path):
    cfg = small_config(tmp_path, kind="llama", layers=2, steps=1)
    cfg.model.vocab_size = 4096  # 4096 x 64 = 262k elements against a block's ~49k
    cfg.model.vocab_pieces = auto_pieces(
        build_model(cfg.model, param_dtype=torch.float32, seed=0)[0]
    )  # as the planner cuts
    with Trainer(cfg) as tr:
        block = max(u.numel for u in tr.layout.units[len(tr.model.embed_pieces) + 1 :][:2])
        assert len(tr.model.embed_pieces) == len(tr.model.head_pieces) > 1
        assert tr.layout.max_unit_numel == block  # no vocabulary-sized unit sets the pools
        assert rows_per_piece(None, 4096, 64, block // 1) * 64 <= block
        tr.initialize(progress=False)
        rec = tr.train_step()
        used = tr.executor.pieces_used
        assert 0 < len(used) < len(tr.model.embed_pieces)  # byte text uses the low ids only
        piece_bytes = tr.layout.units[0].numel * 4

        def traffic(used):
            return step_traffic(
                tr.cfg, tr.model, tr.layout, tr.dtype, tr.rt.align, hidden=tr.rt.hidden_size, kept=0, used_pieces=used
            )

        assert rec.ssd_read_bytes == traffic(used).read  # the forward read the used pieces only
        assert traffic(None).read - traffic(used).read == (len(tr.model.embed_pieces) - len(used)) * piece_bytes
    cfg.model.vocab_pieces = 1
    with Trainer(cfg) as tr:
        assert not tr.model.head_pieces and tr.layout.max_unit_numel >= 4096 * 64


def test_bad_vocab_pieces_named(tmp_path):
    with pytest.raises(ConfigError, match="model.vocab_pieces = 0"):
        small_config(tmp_path).model.__class__(vocab_pieces=0)
    cfg = small_config(tmp_path)
    cfg.model.vocab_pieces = 300
    with pytest.raises(ConfigError, match="vocab_pieces = 300 is more than the vocabulary's 256 rows"):
        build_model(cfg.model, param_dtype=torch.float32, seed=0)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_cut_checkpoint_exports_whole_matrices_that_load_uncut(tmp_path, kind):
    """An export of a cut run has the uncut model's names and shapes (transformers loads a
    Llama one); an uncut model starts from it with the same weights, and a differently cut
    one reads the whole matrices by rows."""
    cfg = small_config(tmp_path / "a", kind=kind, steps=2)
    cfg.model.vocab_pieces = 3
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        tr.train_step()
        res = tr.save_checkpoint()
        want = tr.weights()
        names = _hf_names(tr.model) if kind != "gpt" else {k: k for k in want}
    out = export_checkpoint(res.path, str(tmp_path / "export"))
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        keys = set(json.load(f)["weight_map"])
    assert keys == {names[k] for k in want} and not any("pieces" in k for k in keys)
    if kind == "llama":
        from transformers import AutoModelForCausalLM

        sd = AutoModelForCausalLM.from_pretrained(out).state_dict()
        assert all(torch.equal(want[k], sd[names[k]]) for k in want)
    for pieces in (1, 2):  # uncut, and cut differently
        cfg2 = small_config(tmp_path / f"b{pieces}", kind=kind)
        cfg2.model.vocab_pieces = pieces
        cfg2.model.init_from = out
        with Trainer(cfg2) as tr2:
            tr2.initialize(progress=False)
            got = tr2.weights()
            assert len(tr2.model.head_pieces) == (0 if pieces == 1 else 2)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_the_compute_probe_times_a_cut_model_and_puts_its_placeholders_back(tmp_path):
    """The cost model's probe runs one piece of each kind (K alike) and no whole matrix."""
    from tiertrain.cost.probe import probe_compute

    cfg = small_config(tmp_path, kind="llama", layers=2)
    cfg.model.vocab_pieces = 4
    with Trainer(cfg) as tr:
        before = [p.data.stride() for p in tr.model.parameters()]
        out = probe_compute(tr.cfg, tr.model, tr.layout, tr.dev, tr.dtype, tr.rt.hidden_size)
        assert all(out[k] > 0 for k in ("embed_fwd_s", "head_s", "block_fwd_s", "block_bwd_s", "act_bytes"))
        assert [p.data.stride() for p in tr.model.parameters()] == before  # zero-memory placeholders again
        assert all(p.grad is None for p in tr.model.parameters())


def _gqa_llama(tmp_path, vocab=6400):
    """A Llama with grouped key/value heads whose vocabulary matrix (6400 x 192) is 3.4 blocks."""
    cfg = small_config(tmp_path, kind="llama", layers=4, d=192, heads=4, steps=3, micro_batches=2)
    cfg.model.n_kv_heads, cfg.model.vocab_size = 2, vocab
    return cfg


@pytest.mark.slow
def test_a_vocabulary_larger_than_a_block_stays_whole_and_exact_by_default(tmp_path):
    """With model.vocab_pieces unset and a budget that holds whole vocabulary units, nothing is
    cut: every tensor bit-identical to plain PyTorch + AdamW (cut by default, all 39 differed)."""
    from test_parity import assert_parity

    cfg = _gqa_llama(tmp_path)
    assert auto_pieces(build_model(cfg.model, param_dtype=torch.float32, seed=0)[0]) == 4  # a cut would be possible
    tr, _ = assert_parity(cfg)
    assert not tr.model.embed_pieces and not tr.model.head_pieces
    assert not any("vocabulary cut" in n for n in tr.budget.notes)


@pytest.mark.slow
def test_the_plan_cuts_the_vocabulary_only_where_the_budget_needs_it_and_says_so(tmp_path):
    """A host budget between the fixed pools of whole vocabulary units and those of the pieces:
    the planner cuts, says so with what it changes, and the config a checkpoint keeps names
    the pieces; the same budget plus the difference keeps it whole."""
    import dataclasses

    from tiertrain.cost.budget import PoolsOverBudget, resolve_budget
    from tiertrain.runtime import Runtime

    cfg = _gqa_llama(tmp_path)
    needed = []
    for pieces in (None, 4):  # what each needs at the least (buffers shrunk to their floors)
        c = dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, vocab_pieces=pieces),
            memory=dataclasses.replace(cfg.memory, host_mib=1),
        )
        rt = Runtime(c)
        with pytest.raises(PoolsOverBudget) as exc:
            resolve_budget(c, rt, None, lambda: (1 << 20, 0))
        rt.close()
        needed.append(exc.value.needed >> 20)
    whole, cut = needed
    assert whole - cut > 8
    cfg.memory.host_mib = (whole + cut) // 2
    with Trainer(cfg) as tr:
        assert len(tr.model.embed_pieces) == len(tr.model.head_pieces) == 4
        note = next(n for n in tr.budget.notes if "vocabulary cut into 4 pieces" in n)
        assert "losses differ from plain PyTorch's by rounding" in note and "memory.host_mib" in note
        assert tr.user_cfg.model.vocab_pieces == 4 and tr.cfg.model.vocab_pieces == 4
        tr.initialize(progress=False)
        tr.train_step()
    cfg.memory.host_mib = whole + 8
    with Trainer(cfg) as tr:
        assert not tr.model.embed_pieces and tr.user_cfg.model.vocab_pieces is None


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_initial_weights_do_not_depend_on_the_cut(tmp_path, kind):
    """The same seed gives the same model cut or whole: the vocabulary matrices are initialised
    whole and then cut, every other unit from the seed of its place in the whole model (the
    loss of step 1 differed: 9.0214 cut against 9.0242 whole)."""
    from tiertrain.models.base import unit_param_names
    from tiertrain.models.pieces import WholeTensors

    cfg = small_config(tmp_path, kind=kind, layers=2)
    cfg.model.vocab_size = 8192

    def initial(pieces):
        cfg.model.vocab_pieces = pieces
        model, source = build_model(cfg.model, param_dtype=torch.float32, seed=3)
        whole, out = WholeTensors(model.row_pieces), {}
        for u, own in enumerate(unit_param_names(model)):
            for name, t in source.load(u, [n for n, _ in own]).items():
                out.update(whole.add(name, t))
        return out

    a, b = initial(None), initial(5)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind,tie", [("llama", False), ("gpt", True)])
def test_lora_on_a_cut_vocabulary_is_peft_within_the_pieces_rounding(tmp_path, kind, tie):
    """Adapters on a model whose embedding and head are cut into pieces (a short budget's choice
    for a large vocabulary): peft's losses and adapters within the cut head's rounding, the
    frozen pieces never given a gradient nor written (the embedding's backward is skipped: every
    piece of it is frozen), the storage tier's reads the cost model's."""
    from test_lora import lora_config, peft_reference
    from test_parity import run_tiertrain

    from tiertrain.cost import run_traffic

    cfg = lora_config(tmp_path, kind, steps=3, tie=tie)
    cfg.model.vocab_pieces = 3
    ref = reference_model(cfg)
    init = weights_of(ref)
    ref, names = peft_reference(cfg, ref)
    ref_losses, ref_weights = reference_train(cfg, ref)
    losses, weights, tr = run_tiertrain(cfg, init)
    assert len(tr.model.head_pieces) == 3 and not tr.executor.embed_trains
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    adapters = dict(tr.rt.adapters.named())
    for name, p in adapters.items():
        torch.testing.assert_close(p.detach(), ref_weights[names[name]], rtol=0, atol=1e-6)
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in adapters.items())
    from test_lora import _initial

    for name, w in weights.items():  # the base, pieces included: never written
        assert torch.equal(w, _initial(tr, init, name)), name
    t = run_traffic(tr)
    assert t.by_state.get("grads", [0, 0]) == [0, 0]
