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


def _causal_ce(logits, labels):
    """Next-token cross-entropy (``ForCausalLMLoss``'s shift and mean over labelled tokens), computed in
    the logits' dtype: transformers' own loss casts the logits to float32 (``logits.float()``), which
    would put a float32 computation into a float64 comparison."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             labels[:, 1:].reshape(-1))


def _lm_loss(model, input_ids, labels):
    out = model(input_ids=input_ids)
    loss = _causal_ce(out.logits.to(model.dtype), labels)  # Mamba returns float32 logits (``.float()``)
    if getattr(out, "aux_loss", None) is not None:  # MoE load balancing, as the model adds it
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    return loss


def _token_ce(logits, labels):
    """Cross-entropy of every labelled token (label -100 is ignored), in the logits' dtype."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


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
        return _token_ce(model(input_ids=input_ids, token_type_ids=token_type_ids,
                               attention_mask=attention_mask).logits, labels)

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


# --- more architectures (issue 13: decoder, encoder, encoder-decoder, MoE, vision, windowed attention,
# state-space, contrastive). Sizes are tiny: hidden 32, 2 layers, sequence 16, batch 4, heads even, so
# dp=4 and tp=2 divide every split dim. Every dropout-like probability of the config is set to 0.

def _no_dropout(config):
    """Every float attribute whose name says dropout (``*dropout*``, ``*pdrop``, ``drop_path*``,
    ``layerdrop``) set to 0, in the config and its sub-configs (CLIP's text and vision configs)."""
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("drop" in key.lower()):
            setattr(config, key, 0.0)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _no_dropout(value)
    return config


def _causal_lm(config_cls, model_cls, vocab=128, seq=16, batch=4, **kw):
    torch.manual_seed(0)
    config = _no_dropout(config_cls(vocab_size=vocab, attn_implementation=ATTN, **kw))
    model = model_cls(config)
    ids = _tokens(vocab, batch, seq)
    return model, _adamw(model), _lm_loss, (ids, ids.clone())


def qwen2(layers=2, hidden=32, heads=4, kv_heads=2, inner=64, seq=16, batch=4):
    """Qwen2 causal LM (GQA with q/k/v biases, RMSNorm, RoPE, SwiGLU)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _causal_lm(Qwen2Config, Qwen2ForCausalLM, seq=seq, batch=batch, num_hidden_layers=layers,
                      hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      intermediate_size=inner, max_position_embeddings=64, tie_word_embeddings=False)


def gemma(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, inner=64, seq=16, batch=4):
    """Gemma causal LM (tied embeddings scaled by sqrt(hidden), (1 + w) RMSNorm, GeGLU)."""
    from transformers import GemmaConfig, GemmaForCausalLM
    return _causal_lm(GemmaConfig, GemmaForCausalLM, seq=seq, batch=batch, num_hidden_layers=layers,
                      hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, intermediate_size=inner, max_position_embeddings=64)


def phi(layers=2, hidden=32, heads=4, inner=64, seq=16, batch=4):
    """Phi causal LM (parallel attention and MLP, partial rotary embedding, LayerNorm, biases)."""
    from transformers import PhiConfig, PhiForCausalLM
    return _causal_lm(PhiConfig, PhiForCausalLM, seq=seq, batch=batch, num_hidden_layers=layers,
                      hidden_size=hidden, num_attention_heads=heads, intermediate_size=inner,
                      max_position_embeddings=64, partial_rotary_factor=0.5)


def _mlm_batch(vocab, batch, seq, pad_id):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    masked = (torch.rand(batch, seq, generator=g) < 0.15) & attention_mask.bool()
    masked[:, 0] = True
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    ids = ids.masked_fill(masked, 4).masked_fill(attention_mask == 0, pad_id)
    return ids, attention_mask, labels


def _mlm(config, model_cls, seq, batch):
    model = model_cls(config)
    ids, attention_mask, labels = _mlm_batch(config.vocab_size, batch, seq, config.pad_token_id or 0)

    def loss_fn(model, input_ids, attention_mask, labels):
        return _token_ce(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels)

    return model, _adamw(model), loss_fn, (ids, attention_mask, labels)


def roberta(layers=2, hidden=32, heads=4, vocab=128, seq=16, batch=4):
    """RoBERTa masked LM (positions offset by the padding index) on padded sequences."""
    from transformers import RobertaConfig, RobertaForMaskedLM
    torch.manual_seed(0)
    config = _no_dropout(RobertaConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=2 * hidden,
        vocab_size=vocab, max_position_embeddings=seq + 8, pad_token_id=1, attn_implementation=ATTN))
    return _mlm(config, RobertaForMaskedLM, seq, batch)


def distilbert(layers=2, hidden=32, heads=4, vocab=128, seq=16, batch=4):
    """DistilBERT masked LM (no token types, sinusoid-free learned positions)."""
    from transformers import DistilBertConfig, DistilBertForMaskedLM
    torch.manual_seed(0)
    config = _no_dropout(DistilBertConfig(
        n_layers=layers, dim=hidden, n_heads=heads, hidden_dim=2 * hidden, vocab_size=vocab,
        max_position_embeddings=64, attn_implementation=ATTN))
    return _mlm(config, DistilBertForMaskedLM, seq, batch)


def deberta(layers=2, hidden=32, heads=4, vocab=128, seq=16, batch=4):
    """DeBERTa-v2 masked LM (disentangled relative-position attention with log buckets)."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM
    torch.manual_seed(0)
    config = _no_dropout(DebertaV2Config(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=2 * hidden,
        vocab_size=vocab, max_position_embeddings=64, relative_attention=True, position_buckets=8,
        max_relative_positions=seq, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True))
    return _mlm(config, DebertaV2ForMaskedLM, seq, batch)


def _seq2seq_batch(vocab, batch, seq, pad_id):
    g = torch.Generator().manual_seed(0)
    src = torch.randint(2, vocab, (batch, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    src = src.masked_fill(attention_mask == 0, pad_id)
    labels = torch.randint(2, vocab, (batch, seq // 2), generator=g)
    return src, attention_mask, labels


def _seq2seq(config, model_cls, seq, batch):
    model = model_cls(config)
    src, attention_mask, labels = _seq2seq_batch(config.vocab_size, batch, seq, config.pad_token_id)

    def loss_fn(model, input_ids, attention_mask, labels):  # the model shifts labels into decoder inputs
        return _token_ce(model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits, labels)

    return model, _adamw(model), loss_fn, (src, attention_mask, labels)


def t5(layers=2, hidden=32, heads=4, d_kv=8, inner=64, vocab=128, seq=16, batch=4):
    """T5 encoder-decoder (relative position buckets, RMS LayerNorm, tied embeddings); the decoder
    input is the labels shifted right inside the model."""
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    config = _no_dropout(T5Config(
        vocab_size=vocab, d_model=hidden, d_kv=d_kv, d_ff=inner, num_layers=layers, num_decoder_layers=layers,
        num_heads=heads, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation=ATTN))
    return _seq2seq(config, T5ForConditionalGeneration, seq, batch)


def bart(layers=2, hidden=32, heads=4, inner=64, vocab=128, seq=16, batch=4):
    """BART encoder-decoder (learned positions with offset 2, post-LayerNorm, tied embeddings)."""
    from transformers import BartConfig, BartForConditionalGeneration
    torch.manual_seed(0)
    config = _no_dropout(BartConfig(
        vocab_size=vocab, d_model=hidden, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=inner,
        decoder_ffn_dim=inner, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None, attn_implementation=ATTN))
    return _seq2seq(config, BartForConditionalGeneration, seq, batch)


def _experts():
    """transformers' experts kernel: ``grouped_mm`` (``torch._grouped_mm``, the default, whose fake kernel
    accepts bfloat16 only) except in float64, which the CPU ``grouped_mm`` kernel does not take, where
    eager PyTorch runs the experts through ``batched_mm`` (per-token gathered weights and ``bmm``)."""
    return "batched_mm" if torch.get_default_dtype() == torch.float64 else "grouped_mm"


def mixtral(layers=2, hidden=32, heads=4, kv_heads=2, inner=64, experts=4, top_k=2, seq=16, batch=4):
    """Mixtral sparse MoE causal LM (top-2 of 4 SwiGLU experts per token, load-balancing loss on)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    model, opt, loss_fn, batch_ = _causal_lm(
        MixtralConfig, MixtralForCausalLM, seq=seq, batch=batch, num_hidden_layers=layers, hidden_size=hidden,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inner,
        num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=64,
        output_router_logits=True, router_aux_loss_coef=0.01, tie_word_embeddings=False,
        experts_implementation=_experts())
    return model, opt, loss_fn, batch_


def qwen2_moe(layers=2, hidden=32, heads=4, kv_heads=2, inner=32, experts=4, top_k=2, seq=16, batch=4):
    """Qwen2-MoE causal LM (4 routed experts, top-2, plus a gated shared expert)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return _causal_lm(
        Qwen2MoeConfig, Qwen2MoeForCausalLM, seq=seq, batch=batch, num_hidden_layers=layers, hidden_size=hidden,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=2 * inner,
        moe_intermediate_size=inner, shared_expert_intermediate_size=inner, num_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=64, tie_word_embeddings=False,
        experts_implementation=_experts())


def _image_batch(batch, channels, image, classes):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, channels, image, image, generator=g), torch.randint(classes, (batch,), generator=g)


def _classifier(model, image, classes, batch):
    pixels, labels = _image_batch(batch, 3, image, classes)

    def loss_fn(model, pixel_values, labels):
        return torch.nn.functional.cross_entropy(model(pixel_values=pixel_values).logits, labels)

    return model, _adamw(model), loss_fn, (pixels, labels)


def convnext(hidden=(16, 32), depths=(1, 1), image=32, classes=10, batch=4):
    """ConvNeXt classifier (7x7 depthwise convolutions, channels-last LayerNorm, layer scale)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification
    torch.manual_seed(0)
    config = _no_dropout(ConvNextConfig(hidden_sizes=list(hidden), depths=list(depths), num_labels=classes,
                                        num_stages=len(hidden), image_size=image))
    return _classifier(ConvNextForImageClassification(config), image, classes, batch)


def swin(embed=16, depths=(2, 2), heads=(2, 4), window=4, image=32, patch=2, classes=10, batch=4):
    """Swin Transformer classifier (shifted-window attention with relative position bias, patch merging)."""
    from transformers import SwinConfig, SwinForImageClassification
    torch.manual_seed(0)
    config = _no_dropout(SwinConfig(image_size=image, patch_size=patch, embed_dim=embed, depths=list(depths),
                                    num_heads=list(heads), window_size=window, num_labels=classes))
    return _classifier(SwinForImageClassification(config), image, classes, batch)


def mamba(layers=2, hidden=32, state=8, vocab=128, seq=16, batch=4):
    """Mamba causal LM (selective state-space scan, the sequential PyTorch path; causal conv1d)."""
    from transformers import MambaConfig, MambaForCausalLM
    torch.manual_seed(0)
    config = _no_dropout(MambaConfig(vocab_size=vocab, hidden_size=hidden, state_size=state,
                                     num_hidden_layers=layers, expand=2, conv_kernel=4, use_mambapy=False))
    model = MambaForCausalLM(config)
    ids = _tokens(vocab, batch, seq)
    return model, _adamw(model), _lm_loss, (ids, ids.clone())


def clip(hidden=32, heads=4, layers=2, vocab=128, seq=16, image=32, patch=8, batch=4):
    """CLIP dual encoder trained with its contrastive (image-text cross-entropy both ways) loss."""
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig
    torch.manual_seed(0)
    text = CLIPTextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=seq,
                          projection_dim=hidden, eos_token_id=vocab - 1, pad_token_id=0, bos_token_id=vocab - 2)
    vision = CLIPVisionConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                              num_attention_heads=heads, image_size=image, patch_size=patch, projection_dim=hidden)
    config = _no_dropout(CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                    projection_dim=hidden, attn_implementation=ATTN))
    model = CLIPModel(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab - 2, (batch, seq), generator=g)
    ids[:, -1] = vocab - 1  # the end-of-text token whose state is pooled
    pixels = torch.randn(batch, 3, image, image, generator=g)

    def loss_fn(model, input_ids, pixel_values):
        return model(input_ids=input_ids, pixel_values=pixel_values, return_loss=True).loss

    return model, _adamw(model), loss_fn, (ids, pixels)


# Every workload above, by family (the table of benchmarks/hf_coverage.py and tests/test_hf_models.py).
FAMILIES = {
    "gpt2": "decoder", "llama": "decoder", "qwen2": "decoder", "gemma": "decoder", "phi": "decoder",
    "bert": "encoder", "roberta": "encoder", "distilbert": "encoder", "deberta": "encoder",
    "t5": "encoder-decoder", "bart": "encoder-decoder",
    "mixtral": "MoE", "qwen2_moe": "MoE",
    "vit": "vision", "convnext": "vision", "swin": "windowed attention",
    "mamba": "state-space", "clip": "contrastive",
}
MODELS = list(FAMILIES)
