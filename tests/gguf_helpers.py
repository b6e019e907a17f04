"""Writing tiny GGUF files as llama.cpp's converter would (tests of the GGUF loader, float and quantized)."""
from __future__ import annotations


def gguf_writer(path, arch: str, c, head_dim: int, rope_theta: float = 10000.0):
    """A `gguf.GGUFWriter` at `path` with the architecture's metadata of config `c` (an HF config or our
    ModelConfig: the same field names) filled in; add tensors, then `finish`."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(rope_theta)
    w.add_vocab_size(c.vocab_size)
    return w


def finish(w, path):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def permute(x, n):
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute of Q/K rows (n: query or KV heads)."""
    return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
