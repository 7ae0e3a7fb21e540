"""triton_embed_gateway: OpenAI- and TEI-compatible embeddings HTTP API in front of the ``embed`` ensemble.

Routes (:mod:`triton_embed_gateway.app`), request and response shapes (:mod:`triton_embed_gateway.protocol`), the
gRPC connection to Triton (:mod:`triton_embed_gateway.triton`); ``triton-embed-gateway`` starts it.
"""
