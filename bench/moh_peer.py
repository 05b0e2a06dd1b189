"""The GPU benchmark's peer: Hugging Face transformers' LlamaForCausalLM with
the query-norm router of the official MoH-LLaMA3 modeling code added, so that
the peer computes what the released model's own code computes.

The official code (SkyworkAI/MoH, MoH-LLaMA3/Inference_code/modeling_llama.py,
transcribed in tests/reference/moh_reference.py) is a copy of an older
transformers' modeling_llama.py with two additions to LlamaAttention:
- lines 439-450: from the q_proj output (before RoPE), each routed head's L2
  norm (one torch.norm per head), divided by their unbiased std, a softmax,
  top-K, a one-hot mask over the routed heads, and ones for the shared heads;
- lines 503-505: every head's attention output multiplied by its mask value
  (einsum "bne,bned->bned"), before o_proj.
Every head is computed either way: the router selects, it saves nothing.

The device machines lack that code (and reach no registry), and its copy of
transformers' internals does not run on the transformers they have (5.x). So
the same two steps are added to the installed LlamaForCausalLM through
hooks: a forward hook on each q_proj computes the mask from its output, a
forward pre-hook on each o_proj applies it to its input (the heads' outputs
side by side). This works alike under eager and SDPA attention, prefill and
decode with transformers' KV cache. tests/moh_peer_test.py checks the result
against the reference's golden logits.
"""


def official_routing(num_heads):
    """The released MoH-LLaMA3's heads (modeling_llama.py 361-364): shared
    int(H * 0.5), routed top-K int(H * (0.75 - 0.5)) of the rest."""
    return int(num_heads * 0.5), int(num_heads * (0.75 - 0.5))


def add_official_router(model, shared_heads, routed_k):
    """Adds the official query-norm router to every attention of a
    transformers LlamaForCausalLM `model`; returns the hooks' handles (each
    .remove() takes one away)."""
    import torch
    import torch.nn.functional as F

    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // heads)
    if not 0 < shared_heads < heads or not 0 < routed_k <= heads - shared_heads:
        raise ValueError("shared_heads must be in (0, %d) and routed_k in "
                         "(0, heads - shared_heads], got %d and %d"
                         % (heads, shared_heads, routed_k))
    handles = []
    for layer in model.model.layers:
        attention = layer.self_attn
        state = {}

        def route(module, inputs, query_states, state=state):
            gate = query_states.view(-1, heads, head_dim)
            logits = torch.stack([
                torch.norm(gate[:, i, :], p=2, dim=1)
                for i in range(shared_heads, heads)
            ], dim=1)
            logits_std = logits.std(dim=1, keepdim=True)
            gates = F.softmax(logits / logits_std, dim=1)
            _, indices = torch.topk(gates, routed_k, dim=1)
            routed = F.one_hot(indices, num_classes=heads - shared_heads).sum(dim=1)
            shared = torch.ones(routed.shape[0], shared_heads,
                                dtype=routed.dtype, device=routed.device)
            state["mask"] = torch.cat([shared, routed], dim=-1).to(
                query_states.dtype).view(*query_states.shape[:-1], heads, 1)

        def gate_heads(module, args, state=state):
            (x,) = args
            return ((x.view(*x.shape[:-1], heads, head_dim) *
                     state.pop("mask")).view(x.shape),)

        handles.append(attention.q_proj.register_forward_hook(route))
        handles.append(attention.o_proj.register_forward_pre_hook(gate_heads))
    return handles
