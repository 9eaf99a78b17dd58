"""Framework adapters on the emllm engine: LangChain (ChatEMLLM), LlamaIndex (EMLLM, EMLLMQueryEngine) and the
sentence-transformers + faiss RAG baseline. The engine itself (``emllm``) knows nothing of these frameworks."""
