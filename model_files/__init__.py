"""A model's files, read without torch: the GGUF format (`gguf_reader` parses a file, `gguf` gives
its config, tensors as numpy arrays and tokenizer metadata, and resolves shipped model names),
the tokenizer (`tokenizer`: a checkpoint's tokenizer.json, a GGUF vocabulary through
`gguf_tokenizer`, or bytes) and the chat template (`chat_template`). The engine builds its model
from them; the coordinator only tokenizes and renders chats with them, and loads no engine module
and no torch.
"""
