
mallory