"""The data wing: nothing here needs editing to use another data set (docs/adapt.md says how).

  staging.py     data sets fetched or copied into the data directories, under a lock
  imagesets.py   a data set's splits held in memory or streamed by a DataLoader; image folders
  whitening.py   a first convolution started as the whitening of the training images' patches
"""
