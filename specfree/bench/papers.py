"""What each method's own paper reports, to print beside what ``bench`` measured.

Only numbers found in the source named beside each entry; a field left None was not found (or
the source does not say). These are the headline numbers on the authors' GPUs and 7B-class
models: a CPU run of SmolLM2-135M is not expected to match them, the table shows how far it is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PaperResult:
    method: str  # the specfree strategy that implements it
    paper: str
    model: str | None
    hardware: str | None
    benchmark: str | None
    speedup: float | None  # the reported speedup over autoregressive decoding (the top of a range)
    speedup_low: float | None = None  # the bottom of a reported range
    up_to: bool = False  # reported as "up to"
    accepted: float | None = None  # mean accepted tokens per step (forward), as reported
    source: str = ""

    def speedup_text(self) -> str:
        if self.speedup is None:
            return ""
        text = f"{self.speedup_low:.2f}–{self.speedup:.2f}x" if self.speedup_low else f"{self.speedup:.2f}x"
        return f"up to {text}" if self.up_to else text

    def setting(self) -> str:
        """Model, hardware and benchmark, the known ones."""
        return ", ".join(x for x in (self.model, self.hardware, self.benchmark) if x)


PAPERS: dict[str, PaperResult] = {p.method: p for p in (
    # arXiv 2402.02057 / PMLR 235 abstract: "up to 1.8x on MT-bench" (the 4x is multi-GPU strong
    # scaling on code completion); the abstract names no model or GPU for it.
    PaperResult("lookahead", "Fu et al., ICML 2024 (Lookahead decoding)", None, None, "MT-bench",
                1.8, up_to=True, source="arXiv 2402.02057, abstract"),
    # arXiv 2312.12728v3 abstract: "widely deployed in Alipay ... 2.66x to 6.26x speedup".
    PaperResult("trie", "Zhao et al., KDD 2024 (PIA Lookahead, trie)", None, None, "Alipay production scenarios",
                6.26, speedup_low=2.66, source="arXiv 2312.12728v3, abstract"),
    # github.com/apoorvumang/prompt-lookup-decoding README: "significant speedups (2x-4x) in
    # input-grounded tasks"; setup: single A100 40GB, Mistral-7B-Instruct-v0.1, greedy, n-gram 3, 10 tokens.
    PaperResult("prompt_lookup", "Saxena 2023 (prompt lookup decoding)", "Mistral-7B-Instruct-v0.1",
                "A100 40GB", "summarization, context QA, multi-turn chat", 4.0, speedup_low=2.0,
                source="apoorvumang/prompt-lookup-decoding README, experimental setup"),
    # arXiv 2311.08252 (NAACL 2024) abstract: "7B and 13B language models in a single-batch
    # setting ... 1.62x to 2.36x on code or text generation".
    PaperResult("retrieval", "He et al., NAACL 2024 (REST)", "7B and 13B models", None, "code or text generation",
                2.36, speedup_low=1.62, source="arXiv 2311.08252, abstract"),
    # arXiv 2408.08696v3 abstract: "approximately 2x speedup across all sizes of LLMs".
    PaperResult("recycling", "Luo et al., 2024 (Token Recycling)", "all sizes of LLMs", None, None, 2.0,
                source="arXiv 2408.08696v3, abstract ('approximately 2x')"),
    # arXiv 2411.04975v2 abstract: "speedups of up to 5.3x" on agentic benchmarks (SWE-Bench,
    # Text-to-SQL; 5.3x on AgenticSQL). The NeurIPS 2025 listing's abstract says up to 3.9x.
    PaperResult("suffix", "Oliaro et al., NeurIPS 2025 (SuffixDecoding)", None, None,
                "agentic: SWE-Bench, Text-to-SQL", 5.3, up_to=True, source="arXiv 2411.04975v2, abstract"),
    # github.com/hyx1999/SAM-Decoding README, Spec-Bench table (marked "not final"): SAM-Decoding
    # [Token Recycle] 2.03x overall, 2.98 mean accepted tokens; Vicuna-7B-v1.3, fp16, RTX A6000.
    # (The arXiv v1 abstract says 2.27x with Token Recycling.)
    PaperResult("sam", "Hu et al., ACL 2025 (SAM-Decoding, with Token Recycling)", "Vicuna-7B-v1.3 fp16",
                "RTX A6000", "Spec-Bench", 2.03, accepted=2.98, source="hyx1999/SAM-Decoding README, Spec-Bench table"),
    # arXiv 2507.01449 / ACL Findings 2026 abstract: "up to 2.61x speedup and 3.28 mean accepted
    # tokens per decoding step" over "a wide range of text generation benchmarks".
    PaperResult("logit_spec", "Liu et al., ACL Findings 2026 (LogitSpec)", None, None, "text generation benchmarks",
                2.61, up_to=True, accepted=3.28, source="arXiv 2507.01449, abstract"),
)}


def paper_for(strategy: str) -> PaperResult | None:
    """The paper entry of a strategy name; None for strategies without one (hybrid, plugins)."""
    return PAPERS.get(strategy)
