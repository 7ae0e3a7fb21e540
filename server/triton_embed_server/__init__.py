"""triton_embed_server: model export and the embedded tritonserver for triton-embed."""
