#!/usr/bin/env python3
"""Writes digits.csv: the 8x8 handwritten digits data set that scikit-learn ships
(sklearn.datasets.load_digits, loaded from the package itself, no download).

1797 images of 8x8 pixels with grey levels 0..16 and a label 0..9. Each CSV row is
label,p0,...,p63. The data are a copy of the test set of the UCI "Optical Recognition of
Handwritten Digits" data set (E. Alpaydin, C. Kaynak, 1998; CC BY 4.0).

    pip install scikit-learn && python3 make_digits.py
"""
import csv
import hashlib

from sklearn.datasets import load_digits

digits = load_digits()
with open("digits.csv", "w", newline="") as f:
    w = csv.writer(f, lineterminator="\n")
    for image, label in zip(digits.data.astype(int), digits.target):
        w.writerow([int(label)] + [int(v) for v in image])
with open("digits.csv", "rb") as f:
    print("digits.csv:", len(digits.target), "rows, sha256", hashlib.sha256(f.read()).hexdigest())
