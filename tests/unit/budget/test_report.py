"""`finalize --report FILE.html`: one self-contained page, and a real browser renders its chart."""

import shutil
import struct
import subprocess
import zlib

import pytest

from quantkit.budget.planner import BudgetPlan
from quantkit.budget.report import render
from quantkit.budget.sensitivity import Sensitivity
from quantkit.quant import registry

TYPES = ("Q2_K", "Q4_K", "Q8_0")


def plan() -> BudgetPlan:
    names = ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.v_proj", "lm_head", "token_embd"]
    errors = {name: {t: (i + 1) * 10.0 ** -k for k, t in enumerate(TYPES, 2)} for i, name in enumerate(names)}
    measured = Sensitivity(errors, errors, {"ffn_down": 1.0}, {"ffn_down": 0.1}, {"moments": 1.0}, 256, 1024)
    types = dict(zip(names, ("Q8_0", "Q4_K", "Q4_K", "Q2_K")))
    return BudgetPlan(registry.resolve("gguf-q4-k-m"), types, 4.5, 4.49, 1000, 1780, 0.01, measured)


def test_the_page_is_self_contained_with_a_cell_per_tensor_and_type():
    page = render(plan(), "a <plan>")
    assert page.startswith("<!DOCTYPE html>") and "<title>a &lt;plan&gt;</title>" in page
    assert "<script" not in page and "src=" not in page and "href=" not in page and "@import" not in page
    assert page.count("<rect x=") == 4 * 3 + 1  # the heat map's cells and the budget bar
    assert page.count('stroke="black"') == 4  # the chosen type of each tensor
    assert "4.490 bits per weight planned for a target of 4.5" in page


def _png_pixels(data: bytes) -> list[bytes]:
    """The rows of an 8-bit RGB or RGBA PNG (what Chromium's screenshot writes), unfiltered."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        header = body if kind == b"IHDR" else header
        chunks += [body] if kind == b"IDAT" else []
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and color in (2, 6)
    step = 3 if color == 2 else 4
    raw, rows, previous = zlib.decompress(b"".join(chunks)), [], bytearray(width * step)
    stride = width * step + 1
    for y in range(height):
        kind, line = raw[y * stride], bytearray(raw[y * stride + 1:(y + 1) * stride])
        for x in range(len(line)):
            a = line[x - step] if x >= step else 0
            b, c = previous[x], previous[x - step] if x >= step else 0
            if kind == 1:
                line[x] = (line[x] + a) & 255
            elif kind == 2:
                line[x] = (line[x] + b) & 255
            elif kind == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                near = min((abs(p - a), 0, a), (abs(p - b), 1, b), (abs(p - c), 2, c))[2]
                line[x] = (line[x] + near) & 255
        rows.append(bytes(line) if step == 3 else bytes(v for i, v in enumerate(line) if i % 4 != 3))
        previous = line if step == 3 else line
    return rows


def _screenshot(tmp_path, html: str, name: str = "budget") -> list[tuple[int, int, int]]:
    """The page as Chromium (Debian's, `make test-report` installs it) draws it: rows of RGB pixels."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium here: make test-report installs Debian's")
    page = tmp_path / f"{name}.html"
    page.write_text(html)
    shot = tmp_path / f"{name}.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={shot}",
                    "--window-size=900,1100", page.as_uri()], check=True, capture_output=True, timeout=120)
    return [[tuple(row[i:i + 3]) for i in range(0, len(row), 3)] for row in _png_pixels(shot.read_bytes())]


def _chart_drawn(rows) -> None:
    """The heat map's blue cells, the chosen cells' black outlines and the red target line are on the screenshot."""
    pixels = [pixel for row in rows for pixel in row]
    blue = sum(1 for r, g, b in pixels if b > 200 and r < 200 and abs(r - g) < 8)  # the cells' rgb(s, s, 255)
    black = sum(1 for r, g, b in pixels if r < 40 and g < 40 and b < 40)
    red = sum(1 for r, g, b in pixels if r > 150 and g < 90 and b < 90)  # the target line
    assert blue > 4 * 64 * 16 * 0.5 and black > 200 and red > 50, (blue, black, red)


def _last_drawn_row(rows) -> int:
    return max(y for y, row in enumerate(rows) if any(pixel != (255, 255, 255) for pixel in row))


@pytest.mark.browser
def test_a_headless_browser_renders_the_chart(tmp_path):
    """The SVG draws where it says: cells, outlines and the target line are on the screenshot."""
    _chart_drawn(_screenshot(tmp_path, render(plan())))


@pytest.mark.browser
def test_with_evals_table_the_page_renders_the_chart_and_the_table(tmp_path):
    """`eval --report` on the budget page: the chart as before, and under the plan's table the eval table's rows,
    bordered (#ccc) as the plan's are."""
    from quantkit.evaluation import report as eval_report
    from quantkit.evaluation.evaluate import ModelReport, PerplexityResult

    reports = [ModelReport(m, m, None, None, 10 << 20, PerplexityResult(10.0 + i, 2.3, 100, 1.0, 100.0, 64))
               for i, m in enumerate(("base", "q2", "q4", "q8"))]
    alone, rows = _screenshot(tmp_path, render(plan())), _screenshot(
        tmp_path, eval_report.with_section(render(plan()), eval_report.section(reports)), "with-eval")
    _chart_drawn(rows)
    end = _last_drawn_row(alone)
    below = [pixel for row in rows[end + 1:] for pixel in row]
    borders = sum(1 for pixel in below if pixel == (204, 204, 204))
    assert _last_drawn_row(rows) > end + 5 * 16 and borders > 5 * 200, (end, _last_drawn_row(rows), borders)
