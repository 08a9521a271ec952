# The test bed's tiny models on the device (source after .gpu/device-env.sh, before lib.sh):
# installs the test bed into /tmp/site, builds its models (seeded: the same files on every
# machine) in M=/tmp/tiny-models and points MODEL at the random target.
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site ./testbed \
  > /tmp/testbed-install.log 2>&1 || { tail -20 /tmp/testbed-install.log; exit 1; }
M=/tmp/tiny-models
python3 -m dynspec_testbed.models "$M" > /dev/null || exit 1
export MODEL=$M/target
