"""nowdl run --val-data / --eval --labels / --loss / --keys, and nowdl export: figures checked
against the plain model run on the exported weights."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.image_files import make_files
from helpers.run_cli import step_losses

import nowdl
from nowdl.cli.commands import main
from nowdl.cli.losses import Scores, make_loss
from nowdl.cli.report import read_metrics, summary
from nowdl.errors import NowdlError

ARGS = {"depth": 2, "base_width": 4, "out_channels": 2}
UNET = ["unet", "--model-args", json.dumps(ARGS), "--input", "1x3x32x32", "--workers", "0"]


@pytest.fixture
def files(tmp_path: Path) -> Path:
    make_files(tmp_path)
    return tmp_path


@pytest.fixture(autouse=True)
def _single(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _ok(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(argv)
    cap = capsys.readouterr()
    assert rc == 0, cap
    return cap.out


def _err(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(argv)
    cap = capsys.readouterr()
    assert rc == 2, cap
    assert cap.err.count("\n") == 1, cap.err  # one paragraph
    return cap.err


def _lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(s) for s in (log / "metrics.jsonl").read_text().splitlines()]


def _whole(files: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from helpers.image_files import image

    img = image()
    x = torch.from_numpy(img.transpose(2, 0, 1).copy()).float()[None] / 255.0
    y = torch.from_numpy((img[..., 0] > 127).astype(np.int64))[None]
    return x, y


@pytest.mark.slow
def test_validation_matches_the_exported_model(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log, ck, pt = files / "log", files / "ck", files / "w.pt"
    out = _ok(["run", *UNET, "--batch-size", "2", "--steps", "2", "--data", f"tiff:{files}/img.tif", "--labels",
               f"tiff:{files}/mask.tif", "--val-data", f"tiff:{files}/img.tif", "--val-labels",
               f"tiff:{files}/mask.tif", "--val-every", "1", "--log-dir", str(log), "--checkpoint", str(ck)], capsys)
    assert sorted(step_losses(out)) == [1, 2] and "validation after step 2: loss " in out
    vals = [r for r in _lines(log) if "val" in r]
    assert [v["step"] for v in vals] == [1, 2]  # every step, the last one once
    _ok(["export", str(ck), "--out", str(pt)], capsys)
    model = nowdl.models.unet(**ARGS)
    model.load_state_dict(torch.load(pt), strict=True)  # a plain state_dict under the model's names
    x, y = _whole(files)  # the held-out image whole (64x64), not a 32x32 crop
    with torch.no_grad():
        logits = model.eval()(x)
    want = Scores()
    want.add(logits, y)
    got = vals[-1]["val"]
    assert math.isclose(got["loss"], float(torch.nn.functional.cross_entropy(logits, y)), rel_tol=1e-5)
    for k, v in want.result().items():
        assert math.isclose(got[k], v, rel_tol=1e-9), k
    text = summary(read_metrics(log))
    assert "validation: loss" in text and "2 validation(s)" in text
    # exporting again needs --overwrite; a checkpoint of another model is refused, naming keys
    assert "already exists" in _err(["export", str(ck), "--out", str(pt)], capsys)
    err = _err(["export", str(ck), "--out", str(files / "r.pt"), "--model", "resnet"], capsys)
    assert "holds the weights of another model" in err and not (files / "r.pt").exists()
    assert "no checkpoint in" in _err(["export", str(files), "--out", str(files / "n.pt")], capsys)


def test_eval_with_labels_logs_loss_and_scores(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = files / "log"
    out = _ok(["run", *UNET, "--batch-size", "2", "--steps", "1", "--data", f"tiff:{files}/img.tif", "--labels",
               f"tiff:{files}/mask.tif", "--eval", "--log-dir", str(log)], capsys)
    (rec,) = [r for r in _lines(log) if "step" in r and "val" not in r]
    assert rec["loss"] is not None and math.isfinite(rec["loss"]) and f"loss {rec['loss']:.4f}" in out
    assert 0 <= rec["dice"] <= 1 and 0 <= rec["iou"] <= rec["dice"] and 0 <= rec["accuracy"] <= 1
    assert rec["ranks"][0]["predicted_bytes"] > 0


class DictData(torch.utils.data.Dataset[Any]):
    """MONAI-style dictionary samples: the image and a (1, H, W) label under keys."""

    def __init__(self, n: int = 4) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"img": torch.rand(3, 32, 32, generator=g), "seg": torch.randint(0, 2, (1, 32, 32), generator=g).float()}


class PairData(DictData):
    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        d = super().__getitem__(i)
        return d["img"], d["seg"][0].long()


def make_dict_data() -> DictData:
    return DictData()


def make_pair_data() -> PairData:
    return PairData()


@pytest.mark.slow
def test_keys_and_a_monai_loss(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("monai")
    base = ["run", *UNET, "--batch-size", "2", "--steps", "2"]
    dice_ce = ["--loss", "monai.losses:DiceCELoss", "--loss-args", '{"to_onehot_y": true, "softmax": true}']
    keyed = step_losses(_ok([*base, "--data", "test_validation_cli:make_dict_data", "--keys", "img,seg", *dice_ce],
                            capsys))
    pairs = step_losses(_ok([*base, "--data", "test_validation_cli:make_pair_data", *dice_ce], capsys))
    plain = step_losses(_ok([*base, "--data", "test_validation_cli:make_pair_data"], capsys))
    assert sorted(keyed) == [1, 2] and keyed == pairs  # dictionaries unwrapped to the same pairs
    assert keyed[1] != plain[1]  # DiceCE, not the default cross-entropy


def test_make_loss_gives_monai_losses_channel_labels() -> None:
    monai = pytest.importorskip("monai")
    out = torch.randn(2, 3, 8, 8)
    y = torch.randint(0, 3, (2, 8, 8))
    loss = make_loss("monai.losses:DiceCELoss", '{"to_onehot_y": true, "softmax": true}')
    want = monai.losses.DiceCELoss(to_onehot_y=True, softmax=True)(out, y[:, None])
    torch.testing.assert_close(loss(out, y), want)
    torch.testing.assert_close(make_loss(None, None)(out, y), torch.nn.functional.cross_entropy(out, y))
    with pytest.raises(NowdlError, match="--loss-args goes with --loss"):
        make_loss(None, "{}")
    with pytest.raises(NowdlError, match="not valid JSON"):
        make_loss("monai.losses:DiceCELoss", "{nope")
    with pytest.raises(NowdlError, match="failed: TypeError"):
        make_loss("monai.losses:DiceCELoss", '{"nope": 1}')


def test_scores_by_hand() -> None:
    y = torch.tensor([[[0, 1], [1, 1]]])
    out = torch.zeros(1, 2, 2, 2)
    out[0, 1, 0, 1] = out[0, 1, 0, 0] = 1.0  # predicts class 1 at (0,0) and (0,1)
    s = Scores()
    s.add(out, y)
    r = s.result()
    assert r["dice"] == pytest.approx(2 * 1 / (2 + 3)) and r["iou"] == pytest.approx(1 / 4)
    assert r["accuracy"] == pytest.approx(1 / 4)  # only (0, 1) is right


def test_bad_options(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["run", *UNET, "--batch-size", "2", "--steps", "1", "--data", f"tiff:{files}/img.tif", "--labels",
            f"tiff:{files}/mask.tif"]
    assert "--val-labels goes with --val-data" in _err([*base, "--val-labels", f"tiff:{files}/mask.tif"], capsys)
    assert "--val-every must be a positive" in _err([*base, "--val-data", f"tiff:{files}/img.tif", "--val-labels",
                                                     f"tiff:{files}/mask.tif", "--val-every", "0"], capsys)
    assert "needs --val-labels" in _err([*base, "--val-data", f"tiff:{files}/img.tif"], capsys)
    assert f"{files}/nope.tif does not exist" in _err([*base, "--val-data", f"tiff:{files}/nope.tif", "--val-labels",
                                                       f"tiff:{files}/mask.tif"], capsys)
    assert "--keys goes with --data package.module:callable" in _err([*base, "--keys", "image,label"], capsys)
    assert "--loss-args is not valid JSON" in _err([*base, "--loss", "torch.nn:L1Loss", "--loss-args", "{x"], capsys)
    assert "--loss-args goes with --loss" in _err([*base, "--loss-args", "{}"], capsys)
    err = _err(["run", *UNET, "--batch-size", "2", "--steps", "1", "--data", "test_validation_cli:make_dict_data",
                "--keys", "image,label"], capsys)
    assert "has no key 'image'" in err and "img, seg" in err


@pytest.mark.slow
def test_run_refuses_an_inference_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "infer.json"
    _ok(["plan", "unet", "--model-args", json.dumps(ARGS), "--input", "1x3x32x32", "--gpus", "1", "--inference",
         "--out", str(plan)], capsys)
    assert json.loads(plan.read_text())["config"]["inference"] is True
    err = _err(["run", str(plan), "--steps", "1", "--log-dir", str(tmp_path / "log")], capsys)
    assert "is an inference plan" in err and "cannot train" in err and not (tmp_path / "log").exists()
    out = _ok(["run", str(plan), "--steps", "1", "--eval", "--workers", "0"], capsys)  # it evaluates
    assert "step 1/1" in out
