r"""Labelled (prediction, ground truth, expected verdict) cases for the ``math`` grader, grouped by what they probe.

A prediction is the answer as a model would box it; the test wraps it in ``\boxed{}`` inside a short solution.
"""
T, F = True, False

FRACTIONS = [
    (r"\frac{1}{2}", r"\frac{1}{2}", T), (r"\frac12", r"\frac{1}{2}", T), (r"\dfrac{1}{2}", r"\frac{1}{2}", T),
    (r"\tfrac{1}{2}", r"\frac{1}{2}", T), (r"1/2", r"\frac{1}{2}", T), (r"\frac{2}{4}", r"\frac{1}{2}", T),
    (r"\frac{3}{4}", r"\frac{1}{2}", F), (r"\frac{1}{3}", r"0.333", F), (r"\frac1{3}", r"\frac{1}{3}", T),
    (r"\frac{10}{3}", r"3\frac{1}{3}", T), (r"\frac{7}{2}", r"3.5", T), (r"-\frac{1}{2}", r"\frac{-1}{2}", T),
    (r"\frac{a}{b}", r"\frac{a}{b}", T), (r"\frac{x+1}{2}", r"\frac{1+x}{2}", T), (r"\frac{5}{8}", r"\frac{8}{5}", F),
]
DECIMALS = [
    (r"0.5", r"\frac{1}{2}", T), (r".5", r"0.5", T), (r"0.50", r"0.5", T), (r"2.0", r"2", T), (r"3.14", r"3.14", T),
    (r"3.14", r"3.15", F), (r"0.333333", r"\frac{1}{3}", T), (r"1.25", r"\frac{5}{4}", T), (r"0.1", r"0.01", F),
    (r"-0.75", r"-\frac{3}{4}", T), (r"12.5", r"12.50", T), (r"100.001", r"100", F),
]
LATEX_VARIANTS = [
    (r"\left( 1, 2 \right)", r"(1,2)", T), (r"\left[0,1\right]", r"[0,1]", T), (r"\!5", r"5", T),
    (r"5\,", r"5", T), (r"\displaystyle 7", r"7", T), (r"\boxed{9}", r"9", T), (r"{8}", r"8", T),
    (r"\mathbf{6}", r"6", T), (r"\textbf{4}", r"4", T), (r"\mathrm{3}", r"3", T), (r"2 \cdot 3", r"6", T),
    (r"2\times 3", r"6", T), (r"\sqrt{4}", r"2", T), (r"3^2", r"9", T), (r"\frac{\pi}{2}", r"\dfrac{\pi}{2}", T),
]
INTERVALS = [
    (r"(1,2]", r"(1, 2]", T), (r"[0,\infty)", r"[0, \infty)", T), (r"(-\infty, 3)", r"(-\infty,3)", T),
    (r"(1,2)", r"[1,2]", F), (r"[1,2)", r"[1,2]", F),
    (r"(-\infty,-1)\cup(1,\infty)", r"(-\infty,-1) \cup (1,\infty)", T),
    (r"(0,1)", r"(0,2)", F), (r"[-2, 5]", r"\left[ -2, 5 \right]", T), (r"(2, \infty)", r"(3,\infty)", F),
    (r"x \in [1,4]", r"[1,4]", T),
]
TUPLES = [
    (r"(1,2)", r"(1, 2)", T), (r"(3, -4)", r"(3,-4)", T), (r"(2,1)", r"(1,2)", F), (r"(1,2,3)", r"(1, 2, 3)", T),
    (r"(\frac{1}{2}, 3)", r"(0.5, 3)", T), (r"(1, 2)", r"(1, 2, 3)", F), (r"(0,0)", r"(0, 0)", T),
    (r"(\sqrt{2}, 1)", r"(\sqrt2, 1)", T),
]
SETS = [
    (r"\{1,2\}", r"\{2,1\}", T), (r"\{1, 2, 3\}", r"\{1,2,3\}", T), (r"\{1,2\}", r"\{1,3\}", F),
    (r"1, 2", r"2, 1", T), (r"-1, 3", r"3,-1", T), (r"1, 2", r"1, 3", F), (r"\{-2\}", r"-2", T),
    (r"\{0, 5\}", r"\{5, 0\}", T), (r"2, 3, 4", r"4, 3, 2", T),
]
MATRICES = [
    (r"\begin{pmatrix}1\\2\end{pmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", T),
    (r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", T),
    (r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\begin{pmatrix} 1 & 2 \\ 3 & 5 \end{pmatrix}", F),
    (r"\begin{bmatrix}1\\0\end{bmatrix}", r"\begin{pmatrix}1\\0\end{pmatrix}", T),
    (r"\begin{pmatrix}\frac{1}{2}\\-1\end{pmatrix}", r"\begin{pmatrix}0.5\\-1\end{pmatrix}", T),
    (r"\begin{pmatrix}2\\1\end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", F),
    (r"\begin{pmatrix}0&1\\1&0\end{pmatrix}", r"\begin{pmatrix}0&1\\1&0\end{pmatrix}", T),
]
UNITS = [
    (r"10 \text{ cm}", r"10", T), (r"10\text{ cm}^2", r"10", T), (r"5 \text{ inches}", r"5", T),
    (r"45^\circ", r"45", T), (r"45^{\circ}", r"45", T), (r"90°", r"90", T), (r"\$18.90", r"18.90", T),
    (r"12 \mbox{ units}", r"12", T), (r"7 \text{ dollars}", r"7", T), (r"30 \text{ degrees}", r"30", T),
    (r"3 \text{ cm}", r"4", F), (r"100 meters", r"100", T), (r"6 \text{ feet}", r"6", T),
    (r"15 \text{ minutes}", r"15", T),
]
ROOTS = [
    (r"\sqrt{2}", r"\sqrt2", T), (r"2\sqrt{3}", r"2\sqrt3", T), (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2", T),
    (r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}", T), (r"\sqrt{8}", r"2\sqrt{2}", T), (r"\sqrt{3}", r"\sqrt{2}", F),
    (r"3+\sqrt{5}", r"\sqrt{5}+3", T), (r"\sqrt[3]{8}", r"2", T), (r"4\sqrt{2}", r"\sqrt{32}", T),
    (r"\sqrt{2}+1", r"\sqrt{2}-1", F), (r"1.41421356", r"\sqrt{2}", T),
]
PI = [
    (r"2\pi", r"2 \pi", T), (r"\pi/2", r"\frac{\pi}{2}", T), (r"\frac{3\pi}{4}", r"\frac34\pi", T),
    (r"4\pi", r"2\pi", F), (r"\pi r^2", r"\pi r^{2}", T), (r"6.2832", r"2\pi", F), (r"\frac{\pi}{3}", r"60", F),
    (r"16\pi", r"16 \pi", T), (r"\pi", r"\pi", T),
]
SCIENTIFIC = [
    (r"1.5\times10^{3}", r"1500", T), (r"1.5 \times 10^3", r"1500", T), (r"2\times10^{-3}", r"0.002", T),
    (r"1.5e3", r"1500", T), (r"6.02\times10^{23}", r"6.02 \times 10^{23}", T), (r"3\times10^{4}", r"3000", F),
    (r"10^{6}", r"1000000", T), (r"1,000,000", r"1000000", T), (r"1{,}000", r"1000", T),
]
PERCENTAGES = [
    (r"25\%", r"25", T), (r"25%", r"25", T), (r"50\%", r"50", T), (r"12.5\%", r"12.5", T), (r"30\%", r"40", F),
    (r"33\frac{1}{3}\%", r"33\frac{1}{3}", T), (r"75 \%", r"75", T),
]
NEGATIVES = [
    (r"-3", r"- 3", T), (r"-3", r"3", F), (r"-5", r"-5.0", T), (r"- \frac{2}{3}", r"-\frac{2}{3}", T),
    (r"-\sqrt{2}", r"-\sqrt2", T), (r"(-1,-2)", r"(-1, -2)", T), (r"-0", r"0", T), (r"-10", r"-1", F),
    (r"-2x", r"-2 x", T), (r"3-5", r"-2", T),
]
EXPRESSIONS = [
    (r"x^2-4", r"(x-2)(x+2)", T), (r"2x+1", r"1+2x", T), (r"x^2+2x+1", r"(x+1)^2", T), (r"x+1", r"x-1", F),
    (r"a^2 - b^2", r"(a-b)(a+b)", T), (r"x=3", r"3", T), (r"y = 2x + 1", r"y=2x+1", T), (r"3x", r"x3", T),
    (r"\frac{x}{2}", r"0.5x", T), (r"x^3", r"x^2", F), (r"2^{10}", r"1024", T), (r"\binom{5}{2}", r"10", T),
    (r"5!", r"120", T), (r"\log_2 8", r"3", T), (r"i", r"i", T), (r"1+i", r"1 + i", T), (r"2i", r"-2i", F),
    (r"k = 7", r"7", T), (r"\infty", r"\infty", T), (r"n(n+1)/2", r"\frac{n(n+1)}{2}", T),
]
TEXT_ANSWERS = [
    (r"\text{Monday}", r"\text{Monday}", T), (r"\text{(C)}", r"\text{(C)}", T), (r"\text{even}", r"\text{odd}", F),
    (r"\text{yes}", r"\text{Yes}", T), (r"C", r"\text{C}", T), (r"\text{Devon}", r"Devon", T),
    (r"\text{none}", r"\text{all}", F), (r"\text{(A)}", r"\text{(B)}", F), (r"E", r"E", T),
]
INTEGERS = [
    (r"42", r"42", T), (r"42", r"43", F), (r"0", r"0", T), (r"007", r"7", T), (r"1000", r"1,000", T),
    (r"12345", r"12354", F), (r"3", r"3.0", T), (r"99", r"-99", F), (r"17", r"17.", T),
]
MALFORMED = [
    (r"\frac{1}{", r"\frac{1}{2}", F), (r"", r"5", F), (r"}{", r"1", F), (r"\boxed{", r"1", F),
    (r"((((", r"2", F), (r"\sqrt{", r"2", F), (r"$$", r"0", F), (r"\\", r"1", F), (r"2^{2^{2^{30}}}", r"1", F),
    (r"\frac{1}{0}", r"1", F), (r"x" * 500, r"1", F), (r"NaN", r"1", F), (r"\text{}", r"0", F),
]

GROUPS = {
    "fractions": FRACTIONS, "decimals": DECIMALS, "latex_variants": LATEX_VARIANTS, "intervals": INTERVALS,
    "tuples": TUPLES, "sets": SETS, "matrices": MATRICES, "units": UNITS, "roots": ROOTS, "pi": PI,
    "scientific": SCIENTIFIC, "percentages": PERCENTAGES, "negatives": NEGATIVES, "expressions": EXPRESSIONS,
    "text": TEXT_ANSWERS, "integers": INTEGERS, "malformed": MALFORMED,
}
CASES = [(group, prediction, truth, expected) for group, rows in GROUPS.items() for prediction, truth, expected in rows]
