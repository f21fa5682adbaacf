"""Task metrics on hand-made cases whose answers are worked out by hand."""

import math

import pytest
import torch

from unroller.training.metrics import MetricSet, accuracy, iou, mse, pixel_accuracy, psnr


def test_accuracy_counts_argmax_hits():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 5.0], [9.0, 0.0, 0.0]])
    target = torch.tensor([0, 1, 1, 2])  # rows 0 and 1 right, 2 and 3 wrong
    assert accuracy(logits, target) == 50.0


def test_mse_and_psnr():
    pred = torch.tensor([0.0, 0.5, 1.0, 1.0])
    target = torch.tensor([0.0, 0.0, 1.0, 0.0])  # squared errors 0, .25, 0, 1 -> mean 0.3125
    assert mse(pred, target) == pytest.approx(0.3125)
    assert psnr(0.01) == pytest.approx(20.0)
    assert psnr(0.01, data_range=255.0) == pytest.approx(20.0 + 20 * math.log10(255.0))
    assert psnr(0.0) == math.inf


def test_iou_and_pixel_accuracy():
    pred = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 0]], dtype=torch.bool)
    true = torch.tensor([[1, 0, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    # intersection {(0,0), (1,1)} = 2; union adds (0,1) and (1,2) = 4
    assert iou(pred, true) == pytest.approx(0.5)
    assert pixel_accuracy(pred, true) == pytest.approx(100.0 * 6 / 8)
    empty = torch.zeros(2, 2, dtype=torch.bool)
    assert iou(empty, empty) == 1.0


def test_metric_set_equals_one_big_batch_for_classification():
    torch.manual_seed(0)
    logits, target = torch.randn(10, 4), torch.randint(0, 4, (10,))
    scores = MetricSet("classification")
    scores.update(logits[:3], target[:3])
    scores.update(logits[3:], target[3:])
    result = scores.result()
    assert result["accuracy"] == pytest.approx(accuracy(logits, target))
    expected_loss = torch.nn.functional.cross_entropy(logits.double(), target).item()
    assert result["loss"] == pytest.approx(expected_loss)


def test_metric_set_denoising_psnr_from_whole_set_mse():
    pred = torch.zeros(2, 1, 2, 2)
    target = torch.tensor([[[[0.1, 0.1], [0.1, 0.1]]], [[[0.3, 0.3], [0.3, 0.3]]]])
    scores = MetricSet("denoising")
    scores.update(pred[:1], target[:1])
    scores.update(pred[1:], target[1:])
    result = scores.result()
    assert result["mse"] == pytest.approx((0.01 + 0.09) / 2)
    assert result["psnr"] == pytest.approx(10 * math.log10(1 / 0.05))


def test_metric_set_segmentation_thresholds_probabilities_and_logits():
    prob = torch.tensor([0.9, 0.6, 0.4, 0.1]).reshape(1, 1, 2, 2)
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0]).reshape(1, 1, 2, 2)
    scores = MetricSet("segmentation")
    scores.update(prob, mask)
    result = scores.result()
    # predicted {0, 1}, true {0, 2}: intersection 1, union 3; agree on pixels 0 and 3
    assert result["iou"] == pytest.approx(1 / 3)
    assert result["pixel_accuracy"] == pytest.approx(50.0)
    expected = torch.nn.functional.binary_cross_entropy(prob.double(), mask.double()).item()
    assert result["loss"] == pytest.approx(expected)
    logit_scores = MetricSet("segmentation", logits=True)
    logit_scores.update(torch.logit(prob.double()), mask)
    assert logit_scores.result()["iou"] == pytest.approx(1 / 3)
    assert logit_scores.result()["loss"] == pytest.approx(expected)


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="unknown task"):
        MetricSet("regression")


def test_a_perfect_reconstruction_has_a_finite_psnr_in_reports():
    import json

    scores = MetricSet("autoencoding")
    image = torch.rand(2, 1, 4, 4)
    scores.update(image, image)
    result = scores.result()
    assert result == {"psnr": 100.0, "mse": 0.0}
    json.dumps(result, allow_nan=False)  # valid JSON
