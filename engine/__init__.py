"""The model and the step loop both kinds of worker run: a Llama-family decoder in plain torch
(`model`, `config`, `rope`, `loader`, which reads GGUF files, tokenizers and chat templates
through the torch-free `model_files`), attention over the paged cache behind one
small interface (`attention` selects `attn_torch`, the reference, or `attn_triton`, the paged
kernels), the sampler (`sampling`), the scheduler with recompute/swap preemption (`scheduler`),
beam search (`beam`) and the continuous-batching engine (`engine`), the colocated baseline every
disaggregated result is compared against. It knows nothing of transports, Ray or HTTP.
"""
