"""The paper's architecture (`--arch paper`): document-masked attention through the real data path
(Megatron's GPTDataset masks, the trainer's collate and forward step), the pre+post-norm block
against a plain computation, its initialisation, its routing, and its Hugging Face export
(Gemma3 with Gemma's extras neutralised) reproducing the trainer's logits."""

import pytest
import torch

from tools.synthetic_data import write_markov_dataset
from megatron_world import megatron_world_of_one
from tools.trainer_runs import TINY_VOCAB
from trainer.config import BatchConfig, DataConfig
from trainer.model.presets import PRESETS

PAPER = PRESETS["tiny"].with_overrides(arch="paper")
EOD = 0


def _paper_model(seed: int = 1234):
    from trainer.model.builder import build_model, initialize_weights, padded_vocab_size

    model = build_model(PAPER, padded_vocab_size(TINY_VOCAB, 1))
    initialize_weights(model, PAPER, seed)
    return model.eval()


def _logits(model, batch):
    from trainer.training import _forward_step

    with torch.no_grad():
        # _forward_step computes the loss; the logits come from the same call without labels.
        output = model(batch["tokens"], batch["position_ids"], batch.get("document_ids"))
        assert _forward_step(iter([batch]), model)[0].shape == batch["tokens"].shape  # the trainer's path runs
    return output


@pytest.fixture(scope="module")
def masked_sample(tmp_path_factory):
    """A training micro-batch from GPTDataset with document masking, with an end-of-document inside."""
    from trainer.data import StreamPosition, TokenizerInfo, build_datasets, micro_batches

    base = tmp_path_factory.mktemp("docmask")
    prefix = write_markov_dataset(str(base / "markov"), vocab_size=TINY_VOCAB, num_docs=40, doc_len=120, eod=EOD)
    # 80,20,0: the default 98,2,0 would leave validation one document, short of a sample (trainer/data_splits.py).
    datasets = build_datasets(DataConfig([prefix], split="80,20,0"), TokenizerInfo(TINY_VOCAB, EOD), PAPER.seq_length,
                              seed=1, train_samples=8, valid_samples=1, cache_dir=str(base / "cache"),
                              document_masking=True)
    position = StreamPosition(0, 0, BatchConfig(micro_batch_size=1, gradient_accumulation_steps=1))
    for step in range(8):
        (batch,) = micro_batches(datasets.train, position, step)
        eods = (batch["tokens"][0, :-1] == EOD).nonzero().flatten()
        if len(eods) and 8 < eods[0] < PAPER.seq_length - 8:
            return batch, int(eods[0])
    raise AssertionError("no sample with an end-of-document inside")


def test_document_masking_isolates_documents(masked_sample):
    batch, eod = masked_sample
    ids = batch["document_ids"]  # no [s, s] mask leaves the loader: attention builds it from these
    assert ids.shape == (1, PAPER.seq_length) and ids[0, eod] == ids[0, 0] and ids[0, eod + 1] == ids[0, 0] + 1
    assert batch["position_ids"][0, eod + 1] == 0  # positions restart at the next document
    changed = dict(batch, tokens=batch["tokens"].clone())
    # Replace the preceding document's tokens (not its end-of-document token, which defines the mask).
    changed["tokens"][0, :eod] = (changed["tokens"][0, :eod] + 7) % (TINY_VOCAB - 1) + 1
    with megatron_world_of_one():
        model = _paper_model()
        before, after = _logits(model, batch), _logits(model, changed)
        unmasked = _logits(model, {**changed, "document_ids": None,
                                   "position_ids": torch.arange(PAPER.seq_length).unsqueeze(0)})
        plain = _logits(model, {**batch, "document_ids": None,
                                "position_ids": torch.arange(PAPER.seq_length).unsqueeze(0)})
    # Tokens of the next document do not see the change...
    assert torch.equal(before[0, eod + 1:], after[0, eod + 1:]) or \
        (before[0, eod + 1:] - after[0, eod + 1:]).abs().max() < 1e-5
    # ...tokens of the changed document do, and so would the next document's without the mask.
    assert (before[0, :eod] - after[0, :eod]).abs().max() > 1e-2
    assert (plain[0, eod + 1:] - unmasked[0, eod + 1:]).abs().max() > 1e-2


def test_paper_block_is_pre_and_post_norm():
    """One layer of the Megatron model against h = x + n2(attn(n1(x))), out = h + n4(mlp(n3(h)))."""
    with megatron_world_of_one():
        layer = _paper_model().decoder.layers[0]
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)  # distinguishable norms
            x = torch.randn(16, 2, PAPER.hidden_size)  # [s, b, h]
            got = layer(x, attention_mask=None)[0]
            attn = lambda y: layer.self_attention(y, attention_mask=None)[0]  # noqa: E731
            mlp = lambda y: layer.mlp(y)[0]  # noqa: E731
            h = x + layer.post_self_attn_layernorm(attn(layer.input_layernorm(x)))
            expected = h + layer.post_mlp_layernorm(mlp(layer.pre_mlp_layernorm(h)))
    assert torch.allclose(got, expected, atol=1e-6)


def test_paper_initialisation_and_routing():
    from trainer.model.builder import canonical_names
    from trainer.model.sharding import Split, sharding_of, logical_matrices
    from trainer.optim.routing import route_parameters

    with megatron_world_of_one():
        model = _paper_model()
        params = {canonical_names(model)[n]: p.detach() for n, p in model.named_parameters()}
        routing = route_parameters(model.named_parameters(), use_muon=True)
    adamw = {n for n, _ in routing.adamw}
    for name in params:
        if "post_" in name:
            assert name in adamw and sharding_of(name).split is Split.REPLICATED
    assert abs(params["embedding.word_embeddings.weight"].std() - 1.0) < 0.02
    head = params["output_layer.weight"]
    h = PAPER.hidden_size
    assert abs(head.std() / h ** -0.5 - 0.9866) < 0.03  # the std of a normal truncated at +-3 sigma
    assert head.abs().max() <= 3 * h ** -0.5
    for layer in (0, 3):
        fc1 = logical_matrices("linear_fc1.weight", params[f"decoder.layers.{layer}.mlp.linear_fc1.weight"], PAPER)
        depth = 0.02 / (2 * (layer + 1)) ** 0.5
        assert abs(fc1["gate"].std() / 0.02 - 1) < 0.05 and abs(fc1["up"].std() / depth - 1) < 0.05
        for suffix in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
            assert abs(params[f"decoder.layers.{layer}.{suffix}"].std() / depth - 1) < 0.05
        assert abs(params[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"].std() / 0.02 - 1) < 0.05


def test_hf_export_of_the_paper_model_matches_in_process():
    """The mapping alone (the T=2 P=2 checkpoint round trip is in test_convert_checkpoint)."""
    from transformers import AutoModelForCausalLM

    from tools.convert_checkpoint.hf_mapping import hf_config, hf_tensors
    from trainer.model.builder import canonical_names

    with megatron_world_of_one():
        model = _paper_model()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)  # exercise the (1 + w) storage of Gemma's norms
        names = canonical_names(model)
        tokens = torch.randint(1, TINY_VOCAB, (1, 48))
        with torch.no_grad():
            ours = model(tokens, torch.arange(48).unsqueeze(0), None)[..., :TINY_VOCAB]
        state = {k: v for n, p in model.named_parameters() for k, v in hf_tensors(names[n], p.detach(), PAPER, TINY_VOCAB).items()}
    config = hf_config(PAPER, TINY_VOCAB, {})
    assert config.architectures == ["Gemma3ForCausalLM"]
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and not missing
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
    assert (theirs - ours).abs().max() <= 1e-4 * ours.abs().max()
