export FLAMIA_SITE=/tmp/site_fa4
bash .stage/fa4/part1/install.sh; echo "part1 rc $?"
