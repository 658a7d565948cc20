"""The table of papers: every paper a built-in component cites, written once.

A component's ``source`` is built from here (``str(GAE)``, or :func:`cite` for several
papers with what each contributes), so a paper has one title, one author list, one year and
one link wherever it is cited: ``ppokit show``, ``explain``, the generated docs and the
implementations' docstrings.

Nothing here imports anything of ppokit.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PAPERS", "Paper", "cite"]


@dataclass(frozen=True)
class Paper:
    """One paper: ``Title (Authors, Year), where``."""

    title: str
    authors: str
    year: int
    #: where to read it: ``arXiv:NNNN.NNNNN`` or an address ("" for a book)
    where: str = ""

    def __str__(self) -> str:
        text = f"{self.title} ({self.authors}, {self.year})"
        return f"{text}, {self.where}" if self.where else text


def cite(*parts: Paper | str | tuple[str, Paper]) -> str:
    """Several sources in one line, ``; ``-separated: a paper, ``(what, paper)`` for what a
    paper contributes (``clip-higher: DAPO: ... (Yu et al., 2025), arXiv:...``), or text."""
    out = []
    for part in parts:
        if isinstance(part, tuple):
            what, paper = part
            out.append(f"{what}: {paper}")
        else:
            out.append(str(part))
    return "; ".join(out)


PPO = Paper("Proximal Policy Optimization Algorithms", "Schulman et al.", 2017, "arXiv:1707.06347")
GAE = Paper(
    "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
    "Schulman et al.",
    2016,
    "arXiv:1506.02438",
)
VAPO = Paper(
    "VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning Tasks",
    "Yue et al.",
    2025,
    "arXiv:2504.05118",
)
VC_PPO = Paper(
    "What's Behind PPO's Collapse in Long-CoT? Value Optimization Holds the Secret",
    "Yuan et al.",
    2025,
    "arXiv:2503.01491",
)
GRPO = Paper(
    "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    "Shao et al.",
    2024,
    "arXiv:2402.03300",
)
LITE_PPO = Paper(
    "Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
    "Liu et al.",
    2025,
    "arXiv:2508.08221",
)
GDPO = Paper(
    "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL "
    "Optimization",
    "Liu et al.",
    2026,
    "arXiv:2601.05242",
)
LLM_JUDGE = Paper(
    "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena",
    "Zheng et al.",
    2023,
    "arXiv:2306.05685",
)
HUMANEVAL = Paper(
    "Evaluating Large Language Models Trained on Code", "Chen et al.", 2021, "arXiv:2107.03374"
)
REASONING_GYM = Paper(
    "Reasoning Gym: Reasoning Environments for Reinforcement Learning with Verifiable Rewards",
    "Stojanovski et al.",
    2025,
    "arXiv:2505.24760",
)
OPENRLHF = Paper(
    "OpenRLHF: An Easy-to-use, Scalable and High-performance RLHF Framework",
    "Hu et al.",
    2024,
    "arXiv:2405.11143",
)
DR_GRPO = Paper(
    "Understanding R1-Zero-Like Training: A Critical Perspective",
    "Liu et al.",
    2025,
    "arXiv:2503.20783",
)
RLOO = Paper(
    "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human "
    "Feedback in LLMs",
    "Ahmadian et al.",
    2024,
    "arXiv:2402.14740",
)
REINFORCE_PP = Paper(
    "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
    "Hu",
    2025,
    "arXiv:2501.03262",
)
REMAX = Paper(
    "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning "
    "Large Language Models",
    "Li et al.",
    2024,
    "arXiv:2310.10505",
)
OPO = Paper("On-Policy RL with Optimal Reward Baseline", "Hao et al.", 2025, "arXiv:2505.23585")
DAPO = Paper(
    "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    "Yu et al.",
    2025,
    "arXiv:2503.14476",
)
GSPO = Paper("Group Sequence Policy Optimization", "Zheng et al.", 2025, "arXiv:2507.18071")
CISPO = Paper(
    "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    "MiniMax",
    2025,
    "arXiv:2506.13585",
)
DUAL_CLIP = Paper(
    "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning",
    "Ye et al.",
    2020,
    "arXiv:1912.09729",
)
REINFORCE = Paper(
    "Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement Learning",
    "Williams",
    1992,
)
SUTTON_BARTO = Paper("Reinforcement Learning: An Introduction", "Sutton and Barto", 2018)
TD = Paper("Learning to Predict by the Methods of Temporal Differences", "Sutton", 1988)
KL_APPROX = Paper(
    "Approximating KL Divergence", "J. Schulman", 2020, "http://joschu.net/blog/kl-approx.html"
)
HUBER = Paper("Robust Estimation of a Location Parameter", "P. J. Huber", 1964)
TIME_LIMITS = Paper(
    "Time Limits in Reinforcement Learning", "Pardo et al.", 2018, "arXiv:1712.00378"
)
N_PLUS = Paper(
    "The N+ Implementation Details of RLHF with PPO: A Case Study on TL;DR Summarization",
    "Huang et al.",
    2024,
    "arXiv:2403.17031",
)
TULU3 = Paper(
    "Tulu 3: Pushing Frontiers in Open Language Model Post-Training",
    "Lambert et al.",
    2024,
    "arXiv:2411.15124",
)
R1 = Paper(
    "DeepSeek-R1: Incentivizing Reasoning Capability in LLMs via Reinforcement Learning",
    "DeepSeek-AI",
    2025,
    "arXiv:2501.12948",
)
INSTRUCTGPT = Paper(
    "Training language models to follow instructions with human feedback",
    "Ouyang et al.",
    2022,
    "arXiv:2203.02155",
)
OFF_POLICY = Paper(
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
    "Yao et al.",
    2025,
    "fengyao.notion.site/off-policy-rl",
)
ICEPOP = Paper(
    "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model",
    "Ling Team",
    2025,
    "arXiv:2510.18855",
)
DEEPSEEK_V32 = Paper(
    "DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models",
    "DeepSeek-AI",
    2025,
    "arXiv:2512.02556",
)

PRIME = Paper(
    "Process Reinforcement through Implicit Rewards", "Cui et al.", 2025, "arXiv:2502.01456"
)

PAGED_ATTENTION = Paper(
    "Efficient Memory Management for Large Language Model Serving with PagedAttention",
    "Kwon et al.",
    2023,
    "arXiv:2309.06180",
)

TOOLFORMER = Paper(
    "Toolformer: Language Models Can Teach Themselves to Use Tools",
    "Schick et al.",
    2023,
    "arXiv:2302.04761",
)
SEARCH_R1 = Paper(
    "Search-R1: Training LLMs to Reason and Leverage Search Engines with Reinforcement Learning",
    "Jin et al.",
    2025,
    "arXiv:2503.09516",
)

#: Every paper, by its name here.
PAPERS: dict[str, Paper] = {k: v for k, v in globals().items() if isinstance(v, Paper)}
