b() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }
a=$(b); s=$(date +%s.%N); "$@"; e=$(date +%s.%N); sleep 3; z=$(b)
echo "BUSY $(( (z-a)/100 )) cpu-s; wall $(echo "$e - $s" | bc)"
