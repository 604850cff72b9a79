"""Hugging Face ``transformers`` workloads for tests.

Each function returns ``(model, optimizer, loss_fn, batch)`` like the files in
``examples/``: a tiny model built from a config (random weights, no download),
fp32, every dropout probability set to 0, SDPA attention, trained with AdamW.
"""
import torch
from transformers import (
    BertConfig, BertForMaskedLM,
    GPT2Config, GPT2LMHeadModel,
    LlamaConfig, LlamaForCausalLM,
    ViTConfig, ViTForImageClassification,
)

ATTN = "sdpa"


def _adamw(model, lr=1e-3):
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)


def _tokens(vocab, batch, seq):
    g = torch.Generator().manual_seed(0)
    return torch.randint(vocab, (batch, seq), generator=g)


def _lm_loss(model, input_ids, labels):
    return model(input_ids=input_ids, labels=labels).loss


def gpt2(layers=2, hidden=64, heads=4, vocab=128, seq=32, batch=4):
    """GPT-2 LM (tied embeddings, Conv1D projections); labels are shifted inside the model."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=max(seq, 64),
        bos_token_id=vocab - 1, eos_token_id=vocab - 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        attn_implementation=ATTN,
    )
    model = GPT2LMHeadModel(config)
    ids = _tokens(vocab, batch, seq)
    return model, _adamw(model), _lm_loss, (ids, ids.clone())


def llama(layers=2, hidden=64, heads=4, kv_heads=2, inner=176, vocab=128, seq=32, batch=4):
    """LLaMA causal LM with grouped-query attention (RMSNorm, RoPE, SwiGLU)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=inner, vocab_size=vocab,
        max_position_embeddings=max(seq, 64), attention_dropout=0.0, tie_word_embeddings=False,
        attn_implementation=ATTN,
    )
    model = LlamaForCausalLM(config)
    ids = _tokens(vocab, batch, seq)
    return model, _adamw(model), _lm_loss, (ids, ids.clone())


def bert(layers=2, hidden=64, heads=4, vocab=128, seq=32, batch=4):
    """BERT masked LM on right-padded sentence pairs: ~15% of real tokens become
    [MASK], labels are -100 elsewhere, and an ``attention_mask`` hides the padding."""
    torch.manual_seed(0)
    config = BertConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=max(seq, 64),
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation=ATTN,
    )
    model = BertForMaskedLM(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()  # 1 = real token
    token_type_ids = (torch.arange(seq)[None, :] >= lengths[:, None] // 2).long() * attention_mask
    masked = (torch.rand(batch, seq, generator=g) < 0.15) & attention_mask.bool()
    masked[:, 0] = True
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    ids = ids.masked_fill(masked, 4).masked_fill(attention_mask == 0, config.pad_token_id)  # id 4 plays [MASK]

    def loss_fn(model, input_ids, token_type_ids, attention_mask, labels):
        return model(input_ids=input_ids, token_type_ids=token_type_ids,
                     attention_mask=attention_mask, labels=labels).loss

    return model, _adamw(model, lr=1e-4), loss_fn, (ids, token_type_ids, attention_mask, labels)


def vit(layers=2, hidden=64, heads=4, image=32, patch=8, classes=10, batch=4):
    """ViT image classifier on 3 x image x image inputs (CLS token, learned positions)."""
    torch.manual_seed(0)
    config = ViTConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        intermediate_size=4 * hidden, image_size=image, patch_size=patch, num_channels=3,
        num_labels=classes, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation=ATTN,
    )
    model = ViTForImageClassification(config)
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(batch, 3, image, image, generator=g)
    labels = torch.randint(classes, (batch,), generator=g)

    def loss_fn(model, pixel_values, labels):
        return torch.nn.functional.cross_entropy(model(pixel_values=pixel_values).logits, labels)

    return model, _adamw(model), loss_fn, (pixels, labels)
